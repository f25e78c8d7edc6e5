"""Constant global batch end to end: kills and joins do not change the trajectory.

Real etcd, real elastic-run agents, real gloo: a float64 job with G=100 over a
data set of 1030 samples (a short last batch of 30 per epoch) is killed and
joined through several world sizes (3 does not divide 100), then stopped; its final parameters must equal
the same script run as a plain process (a world of one) for the same number of
steps, and every step's global batch must be the plain run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from tests.fakes.jobs import REPO, TRAIN_JOB, Job, read_jsonl, wait_until

pytestmark = pytest.mark.timeout(420)

DATASET = 1030
GLOBAL_BATCH = 100
SCRIPT = ["--epochs", "1000", "--dataset-size", str(DATASET), "--global-batch-size", str(GLOBAL_BATCH), "--float64"]


def agent(tmp_path, endpoint, job_id, nproc, script_args, *, name):
    """One elastic-run with its own log dir (its events are its own); all write to tmp_path/out."""
    launcher = ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--nproc-per-node", str(nproc),
                "--min-np", "2", "--max-np", "4"]
    job = Job(tmp_path, Job.train_args(tmp_path / "out", tmp_path / f"logs-{name}", launcher, script_args), name=name)
    job.log_dir = tmp_path / f"logs-{name}"
    return job


def worlds(job) -> list[int]:
    return [e["world_size"] for e in job.events() if e["event"] == "round_formed"]


def newest_round_trained(job, world: int, steps: int) -> bool:
    """The newest round has ``world`` ranks and has finished ``steps`` steps."""
    records = job.steps()
    if not records:
        return False
    newest = max(s["round"] for s in records)
    done = {s["step"] for s in records if s["round"] == newest and s["world"] == world}
    return len(done) >= steps


def kill_a_worker_of(job, rank_preference: int) -> None:
    """SIGKILL a live worker that ``job`` started (its agent stays), preferring a rank."""
    started = {e["pid"] for e in job.events() if e["event"] == "worker_started"}
    entries = job.pids()
    newest = max(e["round"] for e in entries)
    mine = sorted((e for e in entries if e["round"] == newest and e["pid"] in started),
                  key=lambda e: (e["rank"] != rank_preference, e["rank"]))
    os.kill(mine[0]["pid"], signal.SIGKILL)


def plain_run(tmp_path, script_args, steps: int) -> tuple[dict, list[dict]]:
    out = tmp_path / "plain"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"  # as elastic-run's workers: a tiny model on a loaded machine
    subprocess.run([sys.executable, str(TRAIN_JOB), *script_args, "--max-steps", str(steps), "--out", str(out)],
                   env=env, check=True, timeout=240, capture_output=True)
    (final,) = out.glob("final-*.pt")
    return torch.load(final, weights_only=True), read_jsonl(out / "steps.jsonl")


def run_through(tmp_path, etcd_server, workers: int, schedule: list[str], script_args: list[str]) -> int:
    """``workers`` workers, then ``schedule`` ("kill" or "join", each followed by a few steps), then stop."""
    job_id = f"gbatch-{uuid.uuid4().hex[:8]}"
    stop_file = tmp_path / "stop"
    args = [*script_args, "--stop-file", str(stop_file), "--step-delay", "0.25"]  # fewer steps: a shorter plain run
    first = agent(tmp_path, etcd_server.endpoint, job_id, workers, args, name="first")
    joiners = []
    expected = [workers]
    kills = 0
    try:
        wait_until(lambda: newest_round_trained(first, workers, 5), 120, f"5 steps of the {workers} workers")
        for change in schedule:
            if change == "kill":
                # Rank 0 first: the new rank 0 must hold the same committed state.
                kill_a_worker_of(first, rank_preference=0 if kills == 0 else 1)
                kills += 1
                expected.append(expected[-1] - 1)
            else:
                joiners.append(agent(tmp_path, etcd_server.endpoint, job_id, 1, args, name=f"joiner{len(joiners)}"))
                expected.append(expected[-1] + 1)
            wait_until(lambda: worlds(first) == expected, 120, f"the worlds {expected} (saw {worlds(first)})")
            # Every world trains; 5 + 6 steps cross the first epoch's end (11 steps),
            # so a short last batch (30 samples) runs at W > 1.
            wait_until(lambda: newest_round_trained(first, expected[-1], 6), 120, f"6 steps at world {expected[-1]}")
        stop_file.touch()
        assert first.wait(120) == 0, first.text()[-3000:]
        for joiner in joiners:
            assert joiner.wait(60) == 0, joiner.text()[-3000:]
    finally:
        for job in [first, *joiners]:
            job.kill()
    assert worlds(first) == expected
    return expected[-1]


def check_same_as_a_plain_run(tmp_path, script_args, last_world: int) -> float:
    records = read_jsonl(tmp_path / "out" / "steps.jsonl")
    # A step redone after a rollback supersedes its first attempt: keep, per step,
    # the records of the newest round that ran it.
    newest_round: dict[int, int] = {}
    for s in records:
        newest_round[s["step"]] = max(newest_round.get(s["step"], 0), s["round"])
    by_step: dict[int, list[int]] = {}
    epoch_of: dict[int, int] = {}
    for s in records:
        if s["round"] == newest_round[s["step"]]:
            by_step.setdefault(s["step"], []).extend(s["indices"])
            epoch_of[s["step"]] = s["epoch"]
    steps = max(by_step)
    assert sorted(by_step) == list(range(1, steps + 1))

    plain_final, plain_records = plain_run(tmp_path, script_args, steps)
    plain_batches = {s["step"]: s["indices"] for s in plain_records}
    assert len(plain_batches) == steps
    for step in range(1, steps + 1):  # the same global batches, whatever the world
        assert sorted(by_step[step]) == sorted(plain_batches[step]), f"step {step}"

    seen_per_epoch: dict[int, list[int]] = {}
    for step, indices in by_step.items():
        seen_per_epoch.setdefault(epoch_of[step], []).extend(indices)
    last = max(seen_per_epoch)
    for epoch, seen in seen_per_epoch.items():
        assert len(seen) == len(set(seen)), f"a sample seen twice in epoch {epoch}"
        if epoch != last:
            assert sorted(seen) == list(range(DATASET)), f"epoch {epoch} missed samples"
    assert last >= 1, "the run should cross an epoch boundary"

    finals = [torch.load(p, weights_only=True) for p in sorted((tmp_path / "out").glob("final-*.pt"))]
    assert len(finals) == last_world  # every worker of the last world
    worst = 0.0
    for params in finals:
        for name, value in plain_final.items():
            assert params[name].dtype == torch.float64
            worst = max(worst, (params[name] - value).abs().max().item())
    assert worst <= 1e-9, f"max parameter difference {worst:g} from the plain run"
    return worst


@pytest.mark.slow
def test_kills_and_joins_through_worlds_4_3_4_3_2_follow_the_plain_trajectory(tmp_path, etcd_server):
    script = [*SCRIPT, "--commit-every", "2"]  # a failure rolls back up to two steps
    last_world = run_through(tmp_path, etcd_server, 4, ["kill", "join", "kill", "kill"], script)
    worst = check_same_as_a_plain_run(tmp_path, script, last_world)
    print(f"max |elastic - plain| parameter difference: {worst:.3g}")


@pytest.mark.slow  # a plain run plus a job with a kill and a join; the unit properties run by default
def test_worlds_3_2_3_with_micro_batches_follow_the_plain_trajectory(tmp_path, etcd_server):
    # M=16: 34/33 per rank at W=3 -> 3 micro-batches, 50 at W=2 -> 4, 100 alone -> 7.
    script = [*SCRIPT, "--micro-batch-size", "16"]
    last_world = run_through(tmp_path, etcd_server, 3, ["kill", "join"], script)
    worst = check_same_as_a_plain_run(tmp_path, script, last_world)
    print(f"max |elastic - plain| parameter difference: {worst:.3g}")
