"""A real job with one slow host: its worker is reported as a straggler, and with
--evict-stragglers its host leaves gracefully and the others' step rate recovers."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.fakes.jobs import Job, read_jsonl, wait_until

# Three agents starting torch, 35+ slow steps, then 30 more: over a minute on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEP_DELAY = 0.1  # every worker's step
# The slow host's steps take 3x as long (issue 10: "a worker slowed 3x is reported within
# 50 steps"): about 0.2 s more on an idle machine. It sleeps twice what its step took, not
# a fixed 0.2 s: scores are ratios of compute time, and a load that lengthens everyone's
# steps would shrink a fixed sleep's ratio towards the 1.5 threshold, not this one's.
SLOW_FACTOR = 3
EXTRA_DELAY = (SLOW_FACTOR - 1) * STEP_DELAY  # the least it adds per step


def _agent(tmp_path: Path, endpoint: str, job_id: str, name: str, stop_file: Path, env=None) -> Job:
    home = tmp_path / name
    home.mkdir()
    launcher = ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--nproc-per-node", "1", "--host-id", name,
                "--min-np", "2", "--max-np", "3", "--rdzv-settle", "3", "--evict-stragglers"]
    script = ["--steps", "100000", "--step-delay", str(STEP_DELAY), "--stop-file", str(stop_file)]
    # One --out for all: steps.jsonl holds every worker's steps; each agent has its own logs.
    return Job(home, Job.train_args(tmp_path / "out", home / "logs", launcher, script), name=name, env=env)


def _step_time(records: list[dict]) -> float:
    """Mean seconds per step over ``records`` (one rank's, in order)."""
    return (records[-1]["t"] - records[0]["t"]) / (records[-1]["step"] - records[0]["step"])


def test_a_slow_host_is_reported_then_evicted_and_the_step_rate_recovers(tmp_path, etcd_server):
    job_id = f"straggler-{uuid.uuid4().hex[:8]}"
    stop_file = tmp_path / "stop"
    fast = [_agent(tmp_path, etcd_server.endpoint, job_id, name, stop_file) for name in ("fast-a", "fast-b")]
    slow = _agent(tmp_path, etcd_server.endpoint, job_id, "slow", stop_file,
                  env={"TRAIN_JOB_SLOW_FACTOR": str(SLOW_FACTOR)})
    jobs = [*fast, slow]
    steps = lambda: read_jsonl(tmp_path / "out" / "steps.jsonl")  # noqa: E731
    try:
        detected = wait_until(
            lambda: [e for e in slow.events() if e["event"] == "straggler_detected"], 180, "a straggler report")[0]
        # Reported within 50 steps of the ring of three, naming the slow host and its rank.
        in_three = sorted({s["step"] for s in steps() if s["world"] == 3 and s["t"] <= detected["time"]})
        assert 0 < len(in_three) <= 50, in_three
        assert detected["host"] == "slow" and detected["ratio"] >= 1.5, detected
        slow_pids = {e["pid"] for e in slow.events() if e["event"] == "worker_started"}
        ranks = {p["rank"] for p in read_jsonl(tmp_path / "out" / "pids.jsonl")
                 if p["pid"] in slow_pids and p["round"] == detected["round"]}
        assert ranks == {detected["rank"]}, (ranks, detected)
        line = f"straggler: host slow rank {detected['rank']} computes"
        logs = lambda: "".join(  # noqa: E731 (the agent copies its worker's output there)
            p.read_text(errors="replace") for p in (tmp_path / "slow" / "logs").glob("worker-*.log"))
        wait_until(lambda: line in logs(), 30, "the straggler's log line")
        assert logs().count(line) == 1
        for job in fast:  # the fast workers are not reported
            assert not [e for e in job.events() if e["event"] == "straggler_detected"]

        # Evicted: the slow host leaves the way SIGTERM makes it leave, exit 0.
        assert slow.wait(120) == 0, slow.text()[-3000:]
        events = [e["event"] for e in slow.events()]
        assert {"straggler_evicted", "graceful_leave"} <= set(events), events
        left = [e for e in slow.events() if e["event"] == "member_left"]
        assert left and left[-1]["graceful"] is True, left

        wait_until(lambda: len({s["step"] for s in steps() if s["world"] == 2}) >= 30, 120, "30 steps without it")
        stop_file.touch()
        for job in fast:
            assert job.wait(120) == 0, job.text()[-3000:]
    finally:
        for job in jobs:
            job.kill()

    records = steps()
    # No step lost or re-run at the switch: each step number was trained in one world only.
    worlds: dict[int, set] = {}
    for s in records:
        worlds.setdefault(s["step"], set()).add(s["world"])
    assert all(len(w) == 1 for w in worlds.values()), {k: w for k, w in worlds.items() if len(w) > 1}
    numbers = sorted(worlds)
    assert numbers == list(range(numbers[0], numbers[-1] + 1))
    # The step rate recovers: the ring of two (after its first steps) against the ring of
    # three just before the report. Compared as step times: the straggler's sleep leaves
    # the step, whatever else the load on this machine adds to both.
    rank0 = lambda world: [s for s in records if s["rank"] == 0 and s["world"] == world]  # noqa: E731
    before, after = _step_time(rank0(3)[-20:]), _step_time(rank0(2)[5:])
    print(f"steps/s with the straggler {1 / before:.2f}, after its eviction {1 / after:.2f}")
    assert before - after > EXTRA_DELAY / 2, (before, after)
