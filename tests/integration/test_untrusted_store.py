"""A stranger who reaches the round's store cannot end the job (security reviews 1 and 2).

Rank 0's agent serves the round's TCPStore; it has no authentication, so whoever can
reach it can write into it. Before, ``switch_at = "0 stop"`` made every other rank exit
0 at its next commit (the job "succeeded" long before its last step), ``"x"`` failed the
job as a user error (exit 3), and later each such value was a ring failure that spent
``--max-resets``. Now the store listens on --host-addr only, and the switch decision
travels in the ring at its switch points (commit_gate.py): nothing a stranger writes
into the store is read for it, so the ring trains on, with no re-formation at all.
"""

from __future__ import annotations

import datetime
import subprocess
import uuid

import pytest
import torch.distributed as dist

from elastic.rendezvous import Etcd, JobKeys
from elastic.rendezvous.rounds import RoundPlan
from tests.fakes.jobs import Job, wait_until

pytestmark = pytest.mark.timeout(300)

STEPS = 150


def _listening(pid: int) -> list[str]:
    """Local addresses the process ``pid`` listens on (TCP)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


# What a stranger wrote where the workers once looked for rank 0's decision: a stop for a
# commit already passed, a malformed value, and a well-formed switch.
VALUES = ("0 stop", "x", "40 switch")


def test_a_value_a_stranger_writes_into_the_round_store_does_not_end_the_job(tmp_path, etcd_server):
    job_id = f"trust-{uuid.uuid4().hex[:10]}"
    out, logs = tmp_path / "out", tmp_path / "logs"
    job = Job(tmp_path, Job.train_args(out, logs, ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id,
                                                   "--host-addr", "127.0.0.1", "--np", "2", "--nproc-per-node", "2",
                                                   "--health-port", "0"],
                                       ["--steps", str(STEPS), "--step-delay", "0.05"]))
    try:
        wait_until(lambda: sum(1 for s in job.steps() if s["world"] == 2) >= 10, 180, "10 steps of the ring")
        # Every server of the agent listens on the job's address, none on all interfaces.
        addresses = _listening(job.proc.pid)
        assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), addresses
        with Etcd(etcd_server.config()) as etcd:
            plan = RoundPlan.from_json(etcd.get(JobKeys(job_id).plan).value)
        host, port = plan.store_addr.rsplit(":", 1)
        stranger = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=10))
        written_at = max(s["step"] for s in job.steps())
        for value in VALUES:
            # Where the round's workers once looked (the round's namespace), and ahead.
            for ahead in (plan.round, plan.round + 1):
                dist.PrefixStore(f"/round/{ahead}/", stranger).set("switch_at", value)
        del stranger
        assert job.wait(240) == 0, job.text()[-3000:]
    finally:
        job.kill()
    steps = job.steps()
    # Training reached its last step in the ring it was in: the strangers' values ended
    # nothing, broke nothing and spent nothing.
    assert max(s["step"] for s in steps) == STEPS, job.text()[-3000:]
    assert written_at < STEPS - 20, "the values were written while the ring still had steps to take"
    assert {s["round"] for s in steps if s["step"] > written_at} == {plan.round}
    events = job.events()
    assert not [e for e in events if e["event"] == "job_finished" and e.get("status") == "stopping"]
    assert not [e for e in events if e["event"] in ("failure_detected", "reform_done")], \
        [e for e in events if e["event"] in ("failure_detected", "reform_done")]
