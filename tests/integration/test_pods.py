"""The worker pods of deploy/cpu as local processes: scale 3 -> 5 -> 3, and the health probe.

Each "pod" is the worker container's own command line and environment (rendered with
kustomize, downward API filled by `pod_command`), pointed at a local embedded etcd.
Scaling up is starting more pods; scaling down is what the kubelet does: SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.fakes.jobs import Job, read_jsonl, wait_until
from tests.fakes.pods import DEPLOY_DIR, REPO_ROOT, free_port, pod_command, render_kustomization
from tests.fakes.stacks import stacks_on_timeout

pytestmark = pytest.mark.timeout(240)

LAUNCHER = [sys.executable, "-m", "elastic.cli"]


class Pod:
    """One worker pod of the rendered Deployment, run as a local process group."""

    def __init__(self, docs, name: str, tmp: Path, etcd_endpoint: str, job_id: str, script_args: list[str]):
        self.name = name
        self.log_dir = tmp / "logs" / name
        argv, env = pod_command(
            docs, pod_name=name, etcd_endpoint=etcd_endpoint, checkpoint_dir=tmp / "ckpt",
            log_dir=self.log_dir, launcher=LAUNCHER, extra_args=script_args,
            # Five pods need room above the overlay's max of 4; a job id of this test's own.
            extra_env={"PYTHONPATH": str(REPO_ROOT), "ELASTIC_MAX_NP": "5", "ELASTIC_JOB_ID": job_id},
        )
        self.health_port = int(env["ELASTIC_HEALTH_PORT"])
        self.output = tmp / f"{name}.txt"
        self._file = open(self.output, "wb")
        self.proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=self._file, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def events(self) -> list[dict]:
        return read_jsonl(self.log_dir / "events.jsonl")

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"pod {self.name} did not exit within {timeout:g}s:\n{self.text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._file.close()


@pytest.fixture
def pods():
    started: list[Pod] = []
    yield started
    for pod in started:
        pod.kill()


@pytest.mark.slow  # 35 s; the default run starts the pod's command line in the health test below
def test_cpu_pods_scale_3_to_5_to_3_without_losing_a_step(tmp_path, etcd_server, pods):
    docs = render_kustomization(DEPLOY_DIR / "cpu")
    progress, result = tmp_path / "progress.jsonl", tmp_path / "result.json"
    stop = tmp_path / "stop"
    # Many epochs: the test ends training with --stop-file once the scale-down is done.
    script_args = ["--epochs", "1000", "--step-delay", "0.1", "--progress", str(progress), "--out", str(result),
                   "--stop-file", str(stop)]
    job_id = f"pods-{uuid.uuid4().hex[:12]}"

    def start(index: int) -> Pod:
        pod = Pod(docs, f"elastic-worker-{index}", tmp_path, etcd_server.endpoint, job_id, script_args)
        pods.append(pod)
        return pod

    def steps() -> list[dict]:
        return read_jsonl(progress)

    def trains_at(world: int, more: int = 3):
        """Wait until `more` steps have run in a ring of `world` workers."""
        def worker_pids():
            return [e["pid"] for pod in pods for e in pod.events() if e["event"] == "worker_started"]

        with stacks_on_timeout(worker_pids):
            wait_until(lambda: sum(1 for s in steps() if s["world"] == world and s["rank"] == 0) >= more,
                       90, f"{more} steps at world size {world}")

    for i in range(3):
        start(i)
    trains_at(3)
    start(3)
    start(4)
    trains_at(5)
    # Scale down: the kubelet SIGTERMs two pods, one of them the pod holding rank 0 (and
    # the round's store). Which pod that is depends on start order: read it from the steps.
    rank0_pid = [s["pid"] for s in steps() if s["world"] == 5 and s["rank"] == 0][-1]
    holder = [pod for pod in pods if any(e["event"] == "worker_started" and e["pid"] == rank0_pid
                                         for e in pod.events())]
    assert len(holder) == 1, (rank0_pid, [pod.events() for pod in pods])
    removed = [holder[0], next(pod for pod in (pods[3], pods[0]) if pod is not holder[0])]
    at_signal = max(s["step"] for s in steps())
    for pod in removed:
        pod.proc.send_signal(signal.SIGTERM)
    for pod in removed:
        assert pod.wait(60) == 0, pod.text()[-3000:]
    wait_until(lambda: any(s["world"] == 3 and s["step"] >= at_signal + 5 for s in steps()), 60,
               "5 more steps on the 3 remaining pods")
    stop.touch()
    remaining = [pod for pod in pods if pod not in removed]
    for pod in remaining:
        assert pod.wait(120) == 0, pod.text()[-3000:]

    records = steps()
    rank0 = [s["step"] for s in records if s["rank"] == 0]
    final = json.loads(result.read_text())
    all_events = [e for pod in pods for e in pod.events()]
    formed = sorted((e for e in all_events if e["event"] == "round_formed"), key=lambda e: e["round"])
    # Each scale step forms one round, or one per pod when their registrations (or their
    # SIGTERMs) land in different settle windows (a slow start: 2 3 4 5 4 3): the sizes
    # only grow up to 5, then only shrink, down to 3.
    formed_worlds = [e["world_size"] for e in formed]
    peak = formed_worlds.index(5)
    growing, shrinking = formed_worlds[: peak + 1], formed_worlds[peak:]
    assert growing == sorted(set(growing)) and 3 in growing, formed
    assert shrinking == sorted(set(shrinking), reverse=True) and shrinking[-1] == 3, formed
    # Training went on throughout, through every size (a round replaced before the ring
    # switched to it may have run no step), and no committed step ran twice.
    worlds = [s["world"] for s in sorted(records, key=lambda s: s["step"]) if s["rank"] == 0]
    changes = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
    assert is_subsequence([3, 5, 3], changes) and changes[-1] == 3, changes
    assert is_subsequence(changes, formed_worlds), (changes, formed_worlds)
    assert sorted(rank0) == list(range(1, final["step"] + 1))
    assert max(s["step"] for s in records if s["world"] == 3 and s["round"] > 1) > at_signal
    assert final["world_size"] == 3 and final["test_accuracy"] > 0.5
    # The old rank 0 left: the survivors' rank 0 is another process.
    assert max((s for s in records if s["rank"] == 0), key=lambda s: s["step"])["pid"] != rank0_pid

    # A graceful scale-down: no worker declared lost, no ring broken, no rollback.
    assert not [e for e in all_events if e["event"] == "failure_detected"], all_events
    assert not [e for e in all_events if e["event"] == "reform_done" and e["failed"]]
    assert not [e for e in formed if "lost" in e["reason"]], formed
    for pod in removed:
        names = [e["event"] for e in pod.events()]
        assert "graceful_leave" in names and names[-1] == "member_left", names
        assert [e["exit_code"] for e in pod.events() if e["event"] == "worker_exited"] == [0]
    # One round per SIGTERM ("1 left" twice) or both in one ("2 left").
    left = [int(e["reason"].split(" left")[0].split()[-1]) for e in formed if e["reason"].endswith(" left")]
    assert sum(left) == 2, formed


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
