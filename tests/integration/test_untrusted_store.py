"""A stranger who reaches the round's store cannot end the job (security review, finding 2).

Rank 0's agent serves the round's TCPStore; it has no authentication, so whoever can
reach it can write into it. Before, ``switch_at = "0 stop"`` made every other rank exit
0 at its next commit (the job "succeeded" long before its last step) and ``"x"``
failed the job as a user error (exit 3). Now the store listens on --host-addr only,
and a worker checks what it reads there: a value rank 0 did not write is a ring
failure, the ring re-forms, and training goes on to its last step.
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


# Each value a worker of a ring reads as a ring failure (malformed; a switch before the
# current commit). One job takes both, one round each: a second job would repeat the
# same start-up (an agent and two workers: ~20 s of CPU) for the same checks.
VALUES = {"0 stop": "impossible at commit", "x": "malformed"}


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
        for value in VALUES:
            with Etcd(etcd_server.config()) as etcd:
                plan = RoundPlan.from_json(etcd.get(JobKeys(job_id).plan).value)
            host, port = plan.store_addr.rsplit(":", 1)
            stranger = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                     timeout=datetime.timedelta(seconds=10))
            # Where the round's workers look (the runtime's PrefixStore for the round).
            dist.PrefixStore(f"/round/{plan.round}/", stranger).set("switch_at", value)
            del stranger
            # The next value goes to the next ring's store, once the workers train in it.
            wait_until(lambda r=plan.round: any(s["round"] > r for s in job.steps()), 120,
                       f"a step after round {plan.round}")
        assert job.wait(240) == 0, job.text()[-3000:]
    finally:
        job.kill()
    steps = job.steps()
    # Training reached its last step: the strangers' values ended nothing.
    assert max(s["step"] for s in steps) == STEPS, job.text()[-3000:]
    events = job.events()
    assert not [e for e in events if e["event"] == "job_finished" and e.get("status") == "stopping"]
    # The worker that read each value saw a ring failure and said why; the ring re-formed at
    # once (the reader shut the ring down under its peers), not after the collective timeout.
    failures = [e.get("reason", "") for e in events if e["event"] == "failure_detected"]
    for value, why in VALUES.items():
        assert any("PeerDataInvalid" in reason and "switch_at" in reason and why in reason for reason in failures), \
            (value, failures)
    reforms = [e for e in events if e["event"] == "reform_done"]
    assert len(reforms) >= 2 and all(e["total_s"] < 30 for e in reforms), reforms
