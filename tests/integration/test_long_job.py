"""A long job wears nothing out: 200 re-formations leave file descriptors, threads and
etcd keys bounded (issue: rounds, requests, plain stores and store keys were never
deleted; --max-resets counted over the process's whole life).

The re-formations are real rounds of a real job: the test asks the coordinator for a
new round (a reset request, as a worker whose ring broke would post), the workers
switch to it at a commit. Slow: about a minute per hundred rounds on this machine.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest

from rendezvous import JobKeys, RoundPlan
from tests.fakes.jobs import Job, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROUNDS = 200


def counts(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def test_200_re_formations_leave_fds_threads_and_keys_bounded(tmp_path, etcd_server, etcd):
    job_id = f"long-{uuid.uuid4().hex[:10]}"
    keys = JobKeys(job_id)
    out, logs = tmp_path / "out", tmp_path / "logs"
    job = Job(tmp_path, Job.train_args(out, logs, [
        "--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
        "--nproc-per-node", "2", "--min-np", "2", "--max-np", "2", ],
        ["--steps", "1000000", "--step-delay", "0.01", "--stop-file", str(tmp_path / "stop")]))
    job.wait_for_step(5, timeout=120)
    workers = [e["pid"] for e in job.pids()]

    def plan_round() -> int:
        kv = etcd.get(keys.plan)
        return RoundPlan.from_json(kv.value).round if kv is not None else 0

    samples = {}
    for i in range(ROUNDS):
        current = plan_round()
        etcd.put(keys.request(f"test-{i % 3}"), json.dumps({"round": current, "reason": "test round"}).encode())
        wait_until(lambda c=current: plan_round() > c, 30, f"round {current + 1}")
        # The workers are on the new round once they stepped in it.
        wait_until(lambda c=current: any(s["round"] > c for s in job.steps()[-10:]), 60, f"steps of round {current + 1}")
        if i in (20, ROUNDS - 1):
            samples[i] = {pid: counts(pid) for pid in [job.proc.pid, *workers]}
    (tmp_path / "stop").touch()
    assert job.wait(120) == 0, job.text()[-3000:]

    # Still the same worker processes: every re-formation happened in-process. (These are
    # planned switches, which do not spend the reset budget; test_reset_budget covers it.)
    assert {e["pid"] for e in job.pids()} == set(workers)
    for pid in samples[20]:
        fds_20, threads_20 = samples[20][pid]
        fds_end, threads_end = samples[ROUNDS - 1][pid]
        assert fds_end <= fds_20 + 4, f"pid {pid}: {fds_20} -> {fds_end} file descriptors"
        assert threads_end <= threads_20 + 2, f"pid {pid}: {threads_20} -> {threads_end} threads"
    all_keys, _ = etcd.get_prefix(keys.prefix)
    names = [kv.key[len(keys.prefix):] for kv in all_keys]
    assert len([n for n in names if n.startswith("rounds/")]) <= 32
    assert not [n for n in names if n.startswith("requests/")], names
    assert len(names) <= 32 + 8, names
