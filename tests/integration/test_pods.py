"""The worker pods of deploy/'s Indexed Job as local processes: scale, preempt, crash, complete.

Each "pod" is the worker container's own command line and environment (rendered with
kustomize, downward API and JOB_COMPLETION_INDEX filled as Kubernetes would by
`pod_command`), pointed at a local embedded etcd. tests/fakes/pods.py's
LocalIndexedJob plays the Job controller: it starts a pod per index, SIGTERMs the
removed indexes on a scale-down, and replaces an ended pod as the manifest's
podFailurePolicy says, reading the decisions from the rendered Job itself.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from elastic.contract.exit_codes import USER_ERROR
from tests.fakes.jobs import TRAIN_JOB, Job, read_jsonl, wait_until
from tests.fakes.pods import (
    DEPLOY_DIR,
    REPO_ROOT,
    LocalIndexedJob,
    LocalPod,
    free_port,
    render_kustomization,
    worker_container,
)
from tests.fakes.stacks import stacks_on_timeout

pytestmark = pytest.mark.timeout(300)

LAUNCHER = [sys.executable, "-m", "elastic.cli"]
# A wait that includes a pod's start: on a loaded 2-core machine importing torch alone
# takes long (the bound of tests/fakes/jobs.py's wait_for_step).
START_S = 120


def events(pod: LocalPod) -> list[dict]:
    return read_jsonl(pod.log_dir / "events.jsonl")


def local_job(docs, tmp: Path, etcd_endpoint: str, script_args: list[str], **env) -> LocalIndexedJob:
    job_id = f"pods-{uuid.uuid4().hex[:12]}"  # a job of this test's own in the shared etcd

    def start(index: int, name: str) -> LocalPod:
        return LocalPod(docs, name, tmp, etcd_endpoint=etcd_endpoint, completion_index=index, launcher=LAUNCHER,
                        extra_args=script_args,
                        extra_env={"PYTHONPATH": str(REPO_ROOT), "ELASTIC_JOB_ID": job_id, **env})

    return LocalIndexedJob(worker_container(docs)[0], start)


@pytest.fixture
def jobs():
    started: list[LocalIndexedJob] = []
    yield started
    for job in started:
        job.kill_all()


@pytest.mark.slow  # about 60 s: five pod starts (on a loaded 2-core machine, imports alone take minutes)
def test_job_pods_scale_up_get_preempted_scale_down_crash_and_complete(tmp_path, etcd_server, jobs):
    docs = render_kustomization(DEPLOY_DIR / "cpu")
    progress, result, stop = tmp_path / "progress.jsonl", tmp_path / "result.json", tmp_path / "stop"
    # Many epochs: the test ends training with --stop-file once the pods have done it all.
    script_args = ["--epochs", "1000", "--step-delay", "0.1", "--progress", str(progress), "--out", str(result),
                   "--stop-file", str(stop)]
    # min-np 1: the crash below leaves one pod training until its replacement joins.
    job = local_job(docs, tmp_path, etcd_server.endpoint, script_args, ELASTIC_MIN_NP="1")
    jobs.append(job)

    def steps() -> list[dict]:
        return read_jsonl(progress)

    def trains_at(world: int, after_step: int = 0, more: int = 3):
        """Wait until `more` steps past `after_step` have run in a ring of `world` workers."""
        def worker_pids():
            return [e["pid"] for pod, _, _ in job.history for e in events(pod) if e["event"] == "worker_started"]

        with stacks_on_timeout(worker_pids):
            wait_until(lambda: sum(1 for s in steps() if s["world"] == world and s["rank"] == 0
                                   and s["step"] > after_step) >= more, START_S, f"{more} steps at world size {world}")
        return max(s["step"] for s in steps())

    def last_step() -> int:
        return max((s["step"] for s in steps()), default=0)

    def trains_in(pod: LocalPod, world: int, more: int = 3):
        """Wait until `pod`'s worker has run `more` steps in a ring of `world` workers."""
        def mine() -> int:
            pids = {e["pid"] for e in events(pod) if e["event"] == "worker_started"}
            return sum(1 for s in steps() if s["pid"] in pids and s["world"] == world)

        wait_until(lambda: mine() >= more, START_S, f"{more} steps of pod {pod.name} at world size {world}")

    job.scale(2)
    trains_at(2)
    job.scale(3)  # up: index 2 joins at a commit
    trains_at(3)

    # Preemption of index 1: SIGTERM, a graceful leave; the pod carries DisruptionTarget.
    # The policy ignores it and a pod with the same index replaces it, as the same host.
    preempted = job.pods[1]
    assert job.end_pod(1, signal.SIGTERM, conditions=["DisruptionTarget"]) == "Ignore"
    replacement = job.pods[1]
    assert replacement is not preempted
    assert replacement.env["ELASTIC_HOST_ID"] == preempted.env["ELASTIC_HOST_ID"] == "elastic-worker-1"
    trains_in(replacement, 3)  # it joined at a commit

    # Scale down: the highest index is deleted (SIGTERM) and leaves gracefully.
    at_scale_down = last_step()
    (removed,) = job.scale(2)
    assert removed.index == 2
    trains_at(2, after_step=at_scale_down)
    graceful_until = time.time()  # no failure before here: every departure so far was a graceful leave

    # A crash: index 0's agent SIGKILLed (as an OOM kill); counted against its back-off.
    at_crash = last_step()
    assert job.end_pod(0, signal.SIGKILL) == "Count"
    assert job.failures == {0: 1}
    # The survivor goes on (alone, or with the replacement of index 0 once it joins);
    # training ends meanwhile: a replacement arriving after the end exits 0 at once.
    wait_until(lambda: last_step() >= at_crash + 3, 90, "training to go on after the crash")

    stop.touch()
    ended = job.wait_all(120)
    # Training over: every pod exits 0 and the Job is Complete.
    assert ended == {0: (0, "Succeeded"), 1: (0, "Succeeded")}, [pod.text()[-2000:] for pod in job.pods.values()]
    assert job.condition() == "Complete"
    codes = [(pod.name, code, action) for pod, code, action in job.history]
    # The crash counted, the two graceful leaves (143) ignored, the two last pods succeeded.
    assert sorted(action for _, _, action in codes) == ["Count", "Ignore", "Ignore", "Succeeded", "Succeeded"], codes
    for pod in (preempted, removed):
        assert next((code, action) for p, code, action in job.history if p is pod) == (143, "Ignore"), codes
    assert next(code for _, code, action in job.history if action == "Count") == 128 + signal.SIGKILL, codes

    records = steps()
    final = json.loads(result.read_text())
    all_events = [e for pod, _, _ in job.history for e in events(pod)]
    # Training went on throughout; no committed step ran twice until the crash (a crash
    # rolls back to the last commit, at most one step).
    rank0 = sorted(s["step"] for s in records if s["rank"] == 0)
    assert rank0[-1] == final["step"] and set(rank0) == set(range(1, final["step"] + 1))
    assert len(rank0) - len(set(rank0)) <= 1
    assert not [s for s in records if s["rank"] == 0 and s["step"] < at_crash and rank0.count(s["step"]) > 1]
    assert final["world_size"] in (1, 2) and final["test_accuracy"] > 0.5
    # Graceful leaves: no worker declared lost, no ring broken before the crash.
    before_crash = [e for e in all_events if e["time"] <= graceful_until]
    assert not [e for e in before_crash if e["event"] == "failure_detected"], before_crash
    assert not [e for e in before_crash if e["event"] == "reform_done" and e["failed"]]
    for pod in (preempted, removed):
        names = [e["event"] for e in events(pod)]
        assert "graceful_leave" in names and names[-1] == "member_left", names
        assert [e["exit_code"] for e in events(pod) if e["event"] == "worker_exited"] == [0]
    # Each arrival and departure formed a round of the expected size: 2, 3, (2,) 3, 2, 1 ...
    formed = [e["world_size"] for e in sorted((e for e in all_events if e["event"] == "round_formed"),
                                              key=lambda e: e["round"])]
    assert is_subsequence([2, 3, 3, 2, 1], formed), formed


@pytest.mark.slow  # about 15 s
def test_job_pods_all_exit_with_the_user_error_status_and_the_job_fails(tmp_path, etcd_server, jobs):
    docs = render_kustomization(DEPLOY_DIR / "cpu")
    # The user's script, as an overlay would set it: rank 1 raises at step 3.
    worker_container(docs)[1]["args"] = ["elastic-run", str(TRAIN_JOB), "--out", str(tmp_path / "out"),
                                         "--steps", "100", "--fail-rank", "1", "--fail-step", "3"]
    job = local_job(docs, tmp_path, etcd_server.endpoint, [], ELASTIC_MIN_NP="2")
    jobs.append(job)
    job.scale(2)
    ended = job.wait_all(120)
    # Every pod, not only the one whose worker raised, ends with elastic-run's user-error
    # status, and the manifest's podFailurePolicy fails the Job on it at once.
    assert ended == {0: (USER_ERROR, "FailJob"), 1: (USER_ERROR, "FailJob")}, \
        [pod.text()[-2000:] for pod in job.pods.values()]
    assert job.condition() == "Failed"


def is_subsequence(items: list, sequence: list) -> bool:
    rest = iter(sequence)
    return all(item in rest for item in items)


# --- the agent's health endpoint ---------------------------------------------------------


def probe(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read().decode()
    except OSError as exc:  # not listening yet
        return 0, str(exc)


def test_health_is_200_once_registered_and_503_once_etcd_is_gone_longer_than_the_ttl(tmp_path, fresh_etcd):
    ttl, port = 2.0, free_port()
    job = Job(tmp_path, Job.train_args(
        tmp_path / "out", tmp_path / "logs",
        ["--rdzv-endpoint", fresh_etcd.endpoint, "--job-id", f"health-{uuid.uuid4().hex[:12]}",
         "--host-addr", "127.0.0.1", "--np", "1", "--min-np", "1", "--rdzv-ttl", str(ttl), "--health-port", str(port)],
        ["--steps", "100000", "--step-delay", "0.05"],
    ))
    try:
        status, body = wait_until(lambda: (r := probe(port))[0] == 200 and r, 30, "health 200")
        assert "registered" in body
        job.wait_for_step(2)

        fresh_etcd.kill()
        killed = time.monotonic()
        assert probe(port)[0] == 200  # an etcd blip shorter than the TTL keeps the pod alive
        status, body = wait_until(lambda: (r := probe(port))[0] == 503 and r, ttl + 10, "health 503")
        lost_after = time.monotonic() - killed
        # Well before the session itself gives up (max(ttl, retry deadline 30 s)).
        assert ttl * 2 / 3 <= lost_after <= ttl + 3, lost_after
        assert "etcd session lost" in body

        fresh_etcd.restart()
        wait_until(lambda: probe(port)[0] == 200, 30, "health 200 again after etcd is back")
    finally:
        job.kill()
