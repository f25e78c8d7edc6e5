"""etcd faults under a running job: etcd is never on the per-step path.

Two namespaced hosts (tests/fakes/netns.py), one agent and worker each, etcd on
the bridge, so the agents reach it over a real link with their own addresses.

* The leader of a three-member etcd cluster is SIGKILLed mid-run: the agents'
  clients fail over to the other members, the lease keep-alives and watches go on,
  and the job neither loses a step nor re-forms its ring.
* The whole etcd down (SIGKILL, restarted after 30 s) or frozen (SIGSTOP 30 s,
  then SIGCONT): training goes on during the outage with no long pause, nobody is
  evicted once etcd is back, the ring is never re-formed, and the job finishes.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from elastic.rendezvous.embedded import EmbeddedEtcdCluster
from tests.fakes.jobs import Job, wait_until

pytestmark = pytest.mark.timeout(420)

OUTAGE_S = 30.0
MAX_GAP_S = 5.0  # generous for a loaded 2-core machine; the figure is printed


def start_agents(tmp_path, endpoint, hosts):
    """One agent per namespaced host (its address: the default, the route to etcd), one
    worker each, a commit every step; stops at the stop file."""
    job_id = f"etcdf-{uuid.uuid4().hex[:10]}"
    out, logs = tmp_path / "out", tmp_path / "logs"
    jobs = []
    for host in hosts:
        args = ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--host-id", host.name,
                "--nproc-per-node", "1", "--min-np", str(len(hosts)), "--max-np", str(len(hosts))]
        jobs.append(host.job(tmp_path, Job.train_args(out, logs, args, [
            "--steps", "100000", "--step-delay", "0.05", "--stop-file", str(tmp_path / "stop")]), name=host.name))
        if len(jobs) == 1:
            first = jobs[0]
            wait_until(lambda: any(e["event"] == "member_joined" for e in first.events()), 60, "first agent")
    return jobs


def steps_of_rank0(job):
    return sorted((s for s in job.steps() if s["rank"] == 0), key=lambda s: s["t"])


def longest_gap(steps, since, until):
    times = [s["t"] for s in steps if since <= s["t"] <= until]
    return max((b - a for a, b in zip(times, times[1:])), default=float("inf")), len(times)


def finish_and_check(tmp_path, jobs, fault_at):
    """Stop the job and check that the fault cost nothing: one round, every step once."""
    (tmp_path / "stop").touch()
    for job in jobs:
        assert job.wait(120) == 0, job.text()[-3000:]
    events = jobs[0].events()  # every agent and worker writes the same events file
    after = [e for e in events if e["time"] >= fault_at]
    for kind in ("round_formed", "failure_detected", "reform_done", "session_lost"):
        assert not [e for e in after if e["event"] == kind], [e for e in after if e["event"] == kind]
    assert len({e["round"] for e in events if e["event"] == "round_formed"}) == 1
    steps = jobs[0].steps()
    for rank in (0, 1):
        numbers = [s["step"] for s in steps if s["rank"] == rank]
        assert numbers == list(range(1, len(numbers) + 1)), f"rank {rank} lost or repeated a step"
        assert len({s["pid"] for s in steps if s["rank"] == rank}) == 1, "a worker was replaced"
    assert [e["status"] for e in events if e["event"] == "job_finished"] == ["succeeded"] * len(jobs)


@pytest.fixture
def hosts_and_cluster(netns_hosts, tmp_path):
    """Two namespaced hosts and a three-member etcd cluster on their bridge."""
    hosts = netns_hosts(2, etcd=False)
    (tmp_path / "etcd-cluster").mkdir()
    cluster = EmbeddedEtcdCluster(3, host=hosts.bridge_addr, log_dir=str(tmp_path / "etcd-cluster")).start()
    yield hosts, cluster
    cluster.stop()


@pytest.mark.slow  # three etcd members and a job: the slow run (CI runs it); the soak kills leaders too
def test_killing_the_etcd_leader_loses_no_step_and_forms_no_round(tmp_path, hosts_and_cluster):
    hosts, etcd_cluster = hosts_and_cluster
    jobs = start_agents(tmp_path, etcd_cluster.endpoints, hosts)
    a = jobs[0]
    wait_until(lambda: len(steps_of_rank0(a)) >= 20, 120, "20 steps of the 2-worker ring")
    leader = etcd_cluster.leader()
    assert leader is not None
    killed_at = time.time()
    leader.kill()
    new_leader = etcd_cluster.wait_leader(60, not_=leader)
    assert new_leader is not None, "no new etcd leader within 60 s"
    # Long enough for every lease keep-alive (ttl/3) and a watch to have failed over.
    wait_until(lambda: len([s for s in steps_of_rank0(a) if s["t"] > killed_at + 12]) >= 5, 90,
               "steps 12 s after the leader died")
    gap, count = longest_gap(steps_of_rank0(a), killed_at - 1, time.time())
    print(f"\netcd leader {leader.name} killed, {new_leader.name} leads: {count} steps in the next 12 s, "
          f"longest gap {gap:.3f}s")
    assert gap < MAX_GAP_S
    finish_and_check(tmp_path, jobs, killed_at)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_etcd_down_or_frozen_for_30s_does_not_stop_or_reform_the_job(tmp_path, netns_hosts, fault):
    hosts = netns_hosts(2)
    fresh_etcd = hosts.etcd
    jobs = start_agents(tmp_path, fresh_etcd.endpoint, hosts)
    a = jobs[0]
    wait_until(lambda: len(steps_of_rank0(a)) >= 20, 120, "20 steps of the 2-worker ring")
    fault_at = time.time()
    if fault == "killed":
        fresh_etcd.kill()
    else:
        os.kill(fresh_etcd.pid, signal.SIGSTOP)
    try:
        # Training goes on: steps keep coming until the very end of the outage.
        wait_until(lambda: [s for s in steps_of_rank0(a) if s["t"] >= fault_at + OUTAGE_S], OUTAGE_S + 30,
                   "steps to the end of the outage")
        for job in jobs:
            assert job.proc.poll() is None, f"an agent gave up during the outage:\n{job.text()[-3000:]}"
    finally:
        if fault == "killed":
            fresh_etcd.restart()
        else:
            os.kill(fresh_etcd.pid, signal.SIGCONT)
    back_at = time.time()
    gap, count = longest_gap(steps_of_rank0(a), fault_at, back_at)
    # Nobody is evicted for the outage: two TTLs after etcd is back the ring is intact.
    wait_until(lambda: [s for s in steps_of_rank0(a) if s["t"] >= back_at + 20], 90, "steps 20 s after etcd returned")
    gap_after, _ = longest_gap(steps_of_rank0(a), back_at, back_at + 20)
    print(f"\netcd {fault} {back_at - fault_at:.1f}s: {count} steps during the outage, longest gap {gap:.3f}s; "
          f"longest gap in the 20 s after {gap_after:.3f}s")
    assert gap < MAX_GAP_S and gap_after < MAX_GAP_S
    finish_and_check(tmp_path, jobs, fault_at)
