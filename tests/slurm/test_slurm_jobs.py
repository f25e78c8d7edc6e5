"""deploy/slurm/elastic-run.sbatch under a real Slurm (22.05 here): slurmctld and one slurmd per namespaced host.

Every job runs the shipped sbatch script, one elastic-run per node, with no
--rdzv-endpoint and no --job-id: they come from Slurm (elastic/cli/slurm.py), the
first node of the allocation serving the embedded etcd. One cluster per module;
the node-loss test runs last, since the node it kills stays dead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from elastic.checkpoint import load_latest
from tests.fakes.slurm_cluster import SlurmJob
from tests.fakes.waiting import poll
from tests.fakes.jobs import REPO, TRAIN_JOB
from tests.integration.test_durable_resume import assert_close

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ELASTIC = ["--min-np", "2", "--max-np", "3", "--rdzv-ttl", "3"]


def _plain_run(tmp_path, steps: int, *script_args: str) -> dict:
    """train_job.py as one plain process: what every worker's parameters must equal."""
    out = tmp_path / "plain"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["PYTHONPATH"] = str(REPO)
    subprocess.run([sys.executable, str(TRAIN_JOB), "--steps", str(steps), "--float64", "--out", str(out),
                    *script_args], env=env, check=True, timeout=300, capture_output=True)
    return _finals(out)[0]


def _finals(out):
    return [torch.load(p, weights_only=True) for p in sorted(out.glob("final-*.pt"))]


def _no_failures(job: SlurmJob) -> None:
    events = job.events()
    assert not [e for e in events if e["event"] == "failure_detected"], job.text()[-3000:]
    assert not [e for e in events if e["event"] == "round_started" and e.get("kind") == "failure"]


def _each_step_trained_once(job: SlurmJob, last: int) -> None:
    """Every step 1..last was trained in exactly one round by a whole ring: nothing rolled back."""
    by_step: dict[int, set] = {}
    for s in job.steps():
        by_step.setdefault(s["step"], set()).add((s["round"], s["world"], s["rank"]))
    assert sorted(by_step) == list(range(1, last + 1))
    for step, records in by_step.items():
        rounds = {(r, w) for r, w, _ in records}
        assert len(rounds) == 1, (step, records)  # trained again in a later round: rolled back
        (_, world), = rounds
        assert sorted(rank for *_, rank in records) == list(range(world)), (step, records)


def test_a_three_node_job_trains_to_the_end_like_a_plain_run(slurm_cluster, tmp_path):
    job = SlurmJob(slurm_cluster, tmp_path, "3", ["--min-np", "3", "--max-np", "3", "tests/fakes/train_job.py",
                                                   "--out", str(tmp_path / "out"), "--steps", "30", "--float64",
                                                   "--global-batch", "30"])  # equal shares of 3 (and of 1)
    assert job.wait() == "COMPLETED", job.text()[-3000:]
    assert "embedded etcd for the Slurm job at" in job.text() and "TLS and auth" in job.text()  # review finding 3
    agents = {e["host"] for e in job.events() if e["event"] == "agent_started"}
    assert agents == set(job.nodes())  # the node names are the host ids
    assert {(s["world"], s["round"]) for s in job.steps()} == {(3, 1)}  # one ring of three, never re-formed
    _no_failures(job)
    params = _finals(job.out)
    assert len(params) == 3
    reference = _plain_run(tmp_path, 30, "--global-batch", "30")
    for p in params:
        assert_close(p, reference)


def test_scancel_signal_term_of_one_nodes_step_is_a_graceful_leave(slurm_cluster, tmp_path):
    stop = tmp_path / "stop"
    job = SlurmJob(slurm_cluster, tmp_path, "3", [*ELASTIC, "tests/fakes/train_job.py", "--out", str(tmp_path / "out"),
                                                   "--steps", "100000", "--step-delay", "0.1", "--stop-file", str(stop)])
    job.wait_for_step(5)
    leaver = job.nodes()[-1]
    # Slurm 22.05's scancel reports "Invalid job id" for a step's signal, yet delivers it.
    slurm_cluster.run("scancel", "--signal=TERM", job.step_on(leaver), check=False)
    assert poll(lambda: [e for e in job.events() if e["event"] == "member_left" and e["host"] == leaver], 60, 0.2), \
        job.text()[-3000:]
    left_at = max(s["step"] for s in job.steps())
    job.wait_for_step(left_at + 5)
    stop.touch()
    assert job.wait() == "COMPLETED", job.text()[-3000:]
    events = job.events()
    assert [e["graceful"] for e in events if e["event"] == "member_left"] == [True]
    # The worker got the step's SIGTERM too, and left it to its agent.
    assert "SIGTERM left to the agent" in job.text()
    _no_failures(job)
    last = max(s["step"] for s in job.steps())
    _each_step_trained_once(job, last)
    assert {s["world"] for s in job.steps() if s["step"] > left_at} == {2}


def test_the_time_limit_signal_stops_at_a_final_checkpoint_and_the_requeued_job_resumes(slurm_cluster, tmp_path):
    steps, ckpt, go = 60, tmp_path / "ckpt", tmp_path / "go"
    # The workers hold at step 5 until the signal has reached both agents, so that the stop at
    # the next commit is what is asserted, not a race with the 55 steps left. (CI once saw the
    # job train to its end: the step's SIGTERM restarted the embedded etcd and every watch
    # re-opened with a dead token, rendezvous/watch.py, so the leave requests went unseen.)
    job = SlurmJob(slurm_cluster, tmp_path, "2", [
        "--min-np", "2", "--max-np", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "100000",
        "tests/fakes/train_job.py", "--out", str(tmp_path / "out"), "--steps", str(steps), "--step-delay", "0.2",
        "--float64", "--wait-file", str(go), "--wait-step", "5"])
    job.wait_for_step(5)
    # What --signal=B:USR1@120 delivers 120 s before the limit (slurmctld's timer itself
    # is not waited for: it fires up to a minute early or late).
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job.id)
    assert poll(lambda: job.text().count("graceful_leave signal=SIGTERM") == 2, 120, 0.1), job.text()[-3000:]
    go.touch()
    assert poll(lambda: "requeueing job" in job.text(), 120, 0.2), job.text()[-3000:]
    # Slurm holds a requeued job for 120 s (BeginTime); the test does not wait for that, but
    # leaves a few seconds: a run launched within the second its predecessor's credential was
    # revoked is refused ("Job credential revoked") and the job fails.
    assert poll(lambda: slurm_cluster.job_state(job.id) == "PENDING", 60, 0.2), slurm_cluster.job_state(job.id)
    slurm_cluster.run("scontrol", "update", f"JobId={job.id}", "StartTime=now+5")
    first_run = job.steps()
    stopped_at = max(s["step"] for s in first_run)
    assert stopped_at < steps
    _, manifest = load_latest(str(ckpt))
    assert manifest["step"] == stopped_at  # the final checkpoint holds the last step trained
    assert job.wait() == "COMPLETED", job.text()[-3000:]
    text = job.text()
    assert re.search(r"run 2\b", text) and f"resumed from durable checkpoint step {stopped_at} " in text, text[-3000:]
    second_run = job.steps()[len(first_run):]
    assert sorted({s["step"] for s in second_run}) == list(range(stopped_at + 1, steps + 1))  # nothing trained again
    assert slurm_cluster.job_field(job.id, "Restarts") == "1"
    reference = _plain_run(tmp_path, steps)
    finals = [torch.load(job.out / f"final-{pid}.pt", weights_only=True) for pid in {s["pid"] for s in second_run}]
    assert len(finals) == 2
    for p in finals:
        assert_close(p, reference)  # equal to an uninterrupted run: the requeue lost nothing


def test_a_second_allocation_joins_the_running_job(slurm_cluster, tmp_path):
    stop, out = tmp_path / "stop", tmp_path / "out"
    script = ["tests/fakes/train_job.py", "--out", str(out), "--steps", "100000", "--step-delay", "0.1",
              "--stop-file", str(stop)]
    first = SlurmJob(slurm_cluster, tmp_path / "first", "2", [*ELASTIC, *script], out=out)
    first.wait_for_step(3)
    join = re.search(r"joins with --rdzv-endpoint (\S+) --job-id (\S+) and ELASTIC_JOB_SECRET_FILE=(\S+)",
                     first.text())
    assert join, first.text()[-3000:]
    endpoint, job_id, secret_file = join.groups()
    # The first run's etcd wants TLS and a password: both come from its job secret.
    second = SlurmJob(slurm_cluster, tmp_path / "second", "1", [*ELASTIC, *script], out=out,
                      env={"ELASTIC_RDZV_ENDPOINT": endpoint, "ELASTIC_JOB_ID": job_id,
                           "ELASTIC_JOB_SECRET_FILE": secret_file})
    assert poll(lambda: any(s["world"] == 3 for s in first.steps()), 240, 0.2), second.text()[-3000:]
    grown_at = min(s["step"] for s in first.steps() if s["world"] == 3)
    first.wait_for_step(grown_at + 3)
    stop.touch()
    assert first.wait() == "COMPLETED", first.text()[-3000:]
    assert second.wait() == "COMPLETED", second.text()[-3000:]
    assert [e["host"] for e in second.events() if e["event"] == "agent_started"] == second.nodes()
    _no_failures(first)
    _no_failures(second)
    _each_step_trained_once(first, max(s["step"] for s in first.steps()))


def test_a_node_that_dies_the_survivors_go_on_and_the_job_completes(slurm_cluster, tmp_path):
    ttl = 3.0
    job = SlurmJob(slurm_cluster, tmp_path, "3", [*ELASTIC, "tests/fakes/train_job.py", "--out", str(tmp_path / "out"),
                                                   "--steps", "120", "--step-delay", "0.1"])
    job.wait_for_step(5)
    victim = next(h for h in slurm_cluster.hosts if h.name == job.nodes()[-1])  # not the etcd's node
    slurm_cluster.kill_node(victim)
    killed_at = time.time()
    assert job.wait() == "COMPLETED", job.text()[-3000:]
    steps = job.steps()
    after = [s for s in steps if s["world"] == 2]
    assert after and max(s["step"] for s in steps) == 120
    gap = min(s["t"] for s in after) - killed_at
    assert gap < ttl + 2, f"survivors' next step {gap:.2f}s after the node died"
    params = _finals(job.out)
    assert len(params) == 2
    for other in params[1:]:
        for name, value in params[0].items():
            assert torch.equal(value, other[name]), name
