"""What a stranger who reaches an agent's round store can no longer do to a real job
(security review 2): end the agent with one key (H2), take the store down with a few KB of
requests or idle connections (H3, M5), end the job by writing switch_at ahead (H4).

On Slurm and bare metal the store listens on the node's address, which every user of
the cluster reaches; here the stranger is a plain TCP client on loopback.
"""

from __future__ import annotations

import datetime
import json
import socket
import struct
import uuid

import pytest
import torch.distributed as dist

from elastic.agent.store_wire import VALIDATION_MAGIC, Query, request
from elastic.rendezvous import Etcd, JobKeys, RoundPlan
from tests.fakes.jobs import Job, wait_until

pytestmark = pytest.mark.timeout(420)


def _plan(etcd_server, job_id: str) -> RoundPlan:
    with Etcd(etcd_server.config()) as etcd:
        return RoundPlan.from_json(etcd.get(JobKeys(job_id).plan).value)


def _reform(etcd_server, job: Job, job_id: str, n: int) -> None:
    """A reset round, asked for as a worker whose ring broke would; waits for its steps."""
    keys = JobKeys(job_id)
    current = _plan(etcd_server, job_id).round
    with Etcd(etcd_server.config()) as etcd:
        etcd.put(keys.request(f"attack-{n}"), json.dumps({"round": current, "reason": "test round"}).encode())
    wait_until(lambda: any(s["round"] > current for s in job.steps()[-10:]), 120, f"steps after round {current}")


def _start(tmp_path, etcd_server, kind: str, steps: int, resets: int):
    job_id = f"{kind}-{uuid.uuid4().hex[:8]}"
    job = Job(tmp_path, Job.train_args(tmp_path / "out", tmp_path / "logs", [
        "--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
        "--np", "2", "--nproc-per-node", "2", "--max-resets", str(resets)],
        ["--steps", str(steps), "--step-delay", "0.05"]))
    wait_until(lambda: sum(1 for s in job.steps() if s["world"] == 2) >= 5, 180, "5 steps of the ring")
    return job_id, job


def test_a_planted_round_key_and_a_store_flood_leave_the_job_training(tmp_path, etcd_server):
    job_id, job = _start(tmp_path, etcd_server, "flood", steps=300, resets=10)
    try:
        host, port = _plan(etcd_server, job_id).store_addr.rsplit(":", 1)
        address = (host, int(port))
        # H2: a 5,000-digit round number; pruning at the next round called int() on it.
        stranger = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=10))
        stranger.set("/round/" + "9" * 5000 + "/x", "1")
        big = b"v" * (8 << 20)
        stranger.set("big", big)
        # H3: 2,000 pipelined GETs of the 8 MiB value (22 KB sent, 16 GB of answers before),
        # never read; M5: 200 connections that never validate.
        flood = socket.create_connection(address)
        flood.sendall(request(Query.VALIDATE, VALIDATION_MAGIC) + request(Query.GET, b"/big") * 2000)
        idle = [socket.create_connection(address) for _ in range(200)]
        _reform(etcd_server, job, job_id, 1)  # the agent prunes (and survives), the ring re-forms
        _reform(etcd_server, job, job_id, 2)
        # The store still answers a client that reads its answers, and dropped the idle ones.
        assert stranger.get("big") == big
        wait_until(lambda: all(s.recv(1) == b"" for s in idle[:5]), 30, "the idle connections to be closed")
        flood.close()
        del stranger
        assert job.wait(300) == 0, job.text()[-3000:]
    finally:
        job.kill()
    assert max(s["step"] for s in job.steps()) == 300
    assert "pruning the round store failed" not in job.text()
    assert not [e for e in job.events() if e.get("user_error")]


@pytest.mark.slow
def test_switch_at_values_written_ahead_spend_no_reset_and_decide_nothing(tmp_path, etcd_server):
    # Review 2, H4: switch_at='x' written for the next rounds made each one a ring failure,
    # spending every worker's --max-resets: the job ended with ResetLimitExceeded.
    job_id, job = _start(tmp_path, etcd_server, "budget", steps=250, resets=2)
    try:
        plan = _plan(etcd_server, job_id)
        host, port = plan.store_addr.rsplit(":", 1)
        stranger = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=10))
        for ahead in range(plan.round, plan.round + 10):
            # Malformed, impossible, and well formed for a commit far ahead (the last one wins).
            for value in ("0 stop", "999999 switch", "x"):
                dist.PrefixStore(f"/round/{ahead}/", stranger).set("switch_at", value)
        del stranger
        _reform(etcd_server, job, job_id, 1)  # one real reset: the budget has room for it, no more
        assert job.wait(300) == 0, job.text()[-3000:]
    finally:
        job.kill()
    assert max(s["step"] for s in job.steps()) == 250
    assert not [e for e in job.events() if e["event"] == "failure_detected" and "switch" in e.get("reason", "")]
