"""Loss of a whole host: its agent and workers SIGKILLed together (a lost VM, an
OOM-killed pod): the host that holds rank 0, the round's store and the coordinator,
a plain host, and the coordinator's host alone (rank 0 moved away first). Three agents
share one etcd, one worker each.

The survivors must not wait for the lost member's lease (--rdzv-ttl, 30 s here):
its agent's port refuses connections, which is proof that it is dead (see
rendezvous/liveness.py), so its lease is revoked and the next round forms at once.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch

from tests.fakes.jobs import Job, wait_until

pytestmark = pytest.mark.timeout(240)

TTL = 30.0  # long on purpose: a recovery bound by the TTL fails the test
# The target is 2 s. Measured on this 2-core machine at load 1-4.5 (2026-11-24):
# rank 0's host 1.26-1.77 s over 11 runs (1.0 s of it was the survivors' wait before they
# looked for a dead coordinator; their agents now look at once: succession.py), a plain host 0.58-0.59 s.
# 3 s of slack for a loaded machine; a wait for the TTL (30 s) still fails it by far.
BOUND_S = 5.0


def three_hosts(tmp_path, etcd_server, extra=()):
    job_id = f"hostloss-{uuid.uuid4().hex[:10]}"
    common = ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
              "--nproc-per-node", "1", "--min-np", "2", "--max-np", "3", "--rdzv-ttl", str(TTL),
              "--collective-timeout", "60", *extra]
    out, logs = tmp_path / "out", tmp_path / "logs"
    script = ["--steps", "100000", "--step-delay", "0.02", "--stop-file", str(tmp_path / "stop")]
    jobs = []
    for name in ("a", "b", "c"):
        jobs.append(Job(tmp_path, Job.train_args(out, logs, [*common, "--host-id", f"host-{name}"], script),
                        name=name))
        # "a" registers first: it leads and holds rank 0 and the store. b and c start
        # together after it (one start of workers, not two one after the other).
        if name == "a":
            wait_until(lambda: any(e["event"] == "member_joined" for e in jobs[0].events()), 60, "a to register")
    wait_until(lambda: any(s["world"] == 3 for s in jobs[0].steps()), 120, "a ring of 3")
    assert [e["rank"] for e in jobs[0].events() if e["event"] == "worker_started" and e["host"] == "host-a"] == [0]
    return jobs


def kill_host(job: Job) -> float:
    """SIGKILL the agent; its workers die with it (parent-death signal)."""
    killed_at = time.time()
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait(10)
    return killed_at


def move_rank0_away_from(a: Job) -> None:
    """Kill a's worker (rank 0); its replacement joins at the end of the rank order, so
    rank 0 and the round's store move to another host while a still leads."""
    before = {e["pid"] for e in a.pids()}
    victim = a.worker_pid(0)
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: [e for e in a.pids() if e["rank"] == 2 and e["pid"] not in before], 180,
               "a's replacement to join last")
    assert a.worker_pid(0) in before - {victim}
    assert "leads (token" in a.text() and "stops leading" not in a.text(), a.text()[-3000:]


@pytest.mark.parametrize("victim", [
    "rank0-store-and-coordinator",
    # A plain host's loss is the simpler path of the same assertions (no successor, no new
    # rank 0): by hand only (`make test-extended`); the default run has the harder one.
    pytest.param("plain", marks=pytest.mark.extended),
    pytest.param("coordinator-only", marks=pytest.mark.slow),
])
def test_survivors_go_on_without_waiting_for_the_lost_hosts_ttl(tmp_path, etcd_server, victim):
    jobs = three_hosts(tmp_path, etcd_server, extra=["--max-restarts", "1"] if victim == "coordinator-only" else ())
    a, b, c = jobs
    if victim == "coordinator-only":
        move_rank0_away_from(a)
    dead, survivors = (a, [b, c]) if victim != "plain" else (c, [a, b])
    events_before = len(a.events())
    killed_at = kill_host(dead)

    def next_step():
        return [s for s in a.steps() if s["t"] > killed_at and s["world"] == 2]

    steps = wait_until(next_step, 2 * TTL, "a step of the 2-worker ring")
    stall = min(s["t"] for s in steps) - killed_at
    print(f"\n{victim}: next step {stall:.2f}s after the host was killed (ttl {TTL:g}s)")
    assert stall < BOUND_S, f"survivors waited {stall:.1f}s (the lease TTL is {TTL:g}s)"

    (tmp_path / "stop").touch()
    for job in survivors:
        assert job.wait(120) == 0, job.text()[-3000:]
    dead.kill()
    finals = [torch.load(p, weights_only=True) for p in sorted(a.out.glob("final-*.pt"))]
    assert len(finals) == 2
    for name, value in finals[0].items():
        assert torch.equal(value, finals[1][name]), name
    # Nobody was counted as a user error, and the job succeeded.
    events = a.events()[events_before:]
    assert not [e for e in events if e.get("user_error")]
    assert any(e["event"] == "job_finished" and e["status"] == "succeeded" for e in events)
