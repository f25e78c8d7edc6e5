"""Rendezvous end to end: real etcd, real member processes, real leases and rounds.

Members run either in processes of their own (tests/fakes/members.py: a real
Participant per process) where the point is concurrency or a crash, or in this
process with one etcd client each (cheaper) where the test inspects a member's
internals (its watches, its request counter). The election tests are in
test_coordinator_election.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.rendezvous import (
    FAILED,
    Etcd,
    JobKeys,
    Participant,
    RendezvousClosedError,
    RendezvousSettings,
    RoundPlan,
)
from tests.fakes.local_members import LocalMembers, has_workers, rounds_in_etcd, worker
from tests.fakes.members import plans_seen, read_records
from tests.fakes.waiting import poll as wait_until

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- member processes


class MemberProcesses:
    """Members in processes of their own (tests/fakes/members.py); always cleaned up."""

    def __init__(self, endpoint: str, job_id: str, directory: Path):
        self.endpoint = endpoint
        self.job_id = job_id
        self.dir = directory
        self.procs: dict[str, subprocess.Popen] = {}
        self.go_file = directory / "go"

    def spawn(self, member_id: str, *, min_np: int, max_np: int, settle: float = 0.3, timeout: float = 30.0,
              ttl: float = 5.0, workers: int = 1, wait_for_go: bool = False) -> Path:
        out = self.out(member_id)
        command = [sys.executable, "-m", "tests.fakes.members", "--endpoint", self.endpoint, "--job", self.job_id,
                   "--member-id", member_id, "--workers", str(workers), "--min-np", str(min_np),
                   "--max-np", str(max_np), "--settle", str(settle), "--timeout", str(timeout),
                   "--ttl", str(ttl), "--out", str(out)]
        if wait_for_go:
            command += ["--go-file", str(self.go_file)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        with open(self.dir / f"{member_id}.log", "wb") as log:
            self.procs[member_id] = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        return out

    def go(self) -> None:
        self.go_file.write_text("go")

    def out(self, member_id: str) -> Path:
        return self.dir / f"{member_id}.jsonl"

    def records(self, member_id: str) -> list[dict]:
        return read_records(self.out(member_id))

    def registered(self, member_id: str) -> dict | None:
        return next((r for r in self.records(member_id) if r["event"] == "registered"), None)

    def wait_registered(self, *member_ids: str, timeout: float = 15.0) -> None:
        ok = wait_until(lambda: all(self.registered(m) for m in member_ids), timeout)
        assert ok, f"not registered within {timeout}s: {[m for m in member_ids if not self.registered(m)]}; " \
                   f"logs: {self.log_tails()}"

    def log_tails(self) -> dict[str, str]:
        return {m: (self.dir / f"{m}.log").read_text()[-400:] for m in self.procs}

    def kill(self, member_id: str) -> None:
        proc = self.procs[member_id]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=5)

    def terminate_all(self, timeout: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


@pytest.fixture
def processes(etcd_server, job_id, tmp_path):
    group = MemberProcesses(etcd_server.endpoint, job_id, tmp_path)
    yield group
    group.terminate_all()


# ----------------------------------------------------------------------------- tests: forming rounds


# Starting member processes (python + grpc imports) takes long on a loaded 2-core
# machine: the waits below are generous, the assertions are about plans, not speed.
@pytest.mark.timeout(120)
def test_four_member_processes_joining_together_form_one_round(processes, etcd, job_id):
    names = [f"m{i}" for i in range(4)]
    for name in names:
        processes.spawn(name, min_np=4, max_np=4, wait_for_go=True)
    processes.go()

    ok = wait_until(lambda: all(1 in plans_seen(processes.out(m)) for m in names), timeout=60.0)
    assert ok, f"not every member saw round 1: {processes.log_tails()}"
    seen = [plans_seen(processes.out(m))[1] for m in names]
    assert all(plan == seen[0] for plan in seen), seen
    plan = RoundPlan.from_json(json.dumps(seen[0]).encode())
    assert plan.round == 1 and plan.world_size == 4
    # Ranks 0..3 follow the join order (the create revisions of the member keys).
    by_join = sorted(names, key=lambda m: processes.registered(m)["revision"])
    assert plan.worker_ids() == tuple(worker(m) for m in by_join)
    assert [plan.rank_of(worker(m)) for m in by_join] == [0, 1, 2, 3]
    assert list(rounds_in_etcd(etcd, JobKeys(job_id))) == [1]


@pytest.mark.timeout(180)
def test_sixteen_member_processes_racing_write_exactly_one_plan_per_round(processes, etcd, job_id):
    names = [f"m{i:02d}" for i in range(16)]
    for name in names:
        processes.spawn(name, min_np=16, max_np=16, wait_for_go=True)
    processes.go()

    ok = wait_until(lambda: all(1 in plans_seen(processes.out(m)) for m in names), timeout=120.0)
    assert ok, f"not every member saw round 1: {processes.log_tails()}"
    rounds = rounds_in_etcd(etcd, JobKeys(job_id))
    assert list(rounds) == [1]
    written = json.loads(rounds[1].to_json())
    for name in names:
        assert plans_seen(processes.out(name))[1] == written, name
    assert set(rounds[1].worker_ids()) == {worker(m) for m in names}

    # Every process leaves gracefully and reports how many rounds its coordinator wrote:
    # one winner in total. (Below min_np after the leaves, no further round forms.)
    # 16 interpreters leaving at once on a loaded 2-core CI machine: the bound is generous
    # (a leave is ~0.2 s idle); one that runs out names the member and what it logged.
    processes.terminate_all(timeout=60.0)
    left = {m: next((r for r in processes.records(m) if r["event"] == "left"), None) for m in names}
    slow = [m for m, r in left.items() if r is None]
    assert not slow, f"did not leave: {slow}; records: {[processes.records(m)[-3:] for m in slow]}; " \
                     f"logs: {[processes.log_tails()[m] for m in slow]}"
    assert sum(r["rounds_written"] for r in left.values()) == 1
    assert list(rounds_in_etcd(etcd, JobKeys(job_id))) == [1]


# ----------------------------------------------------------------------------- tests: leaving, crashing


def test_graceful_leave_keeps_survivor_order_and_oldest_survivor_becomes_rank_0(no_leaked_threads, local):
    settings = RendezvousSettings(2, 16, settle=0.2, timeout=30)
    names = ["a", "b", "c", "d"]
    for name in names:
        local.add(name, settings, workers=2)
    everyone = tuple(worker(m, i) for m in names for i in range(2))
    first = local.wait_for_plan("d", has_workers(*everyone))

    # A member in the middle leaves the way the agent does on SIGTERM: it withdraws its
    # workers as "draining" first (so the plan says they left, not that they were lost),
    # then deletes its key.
    local.by_id["c"].set_workers((), draining=True)
    second = local.wait_for_plan("d", lambda p: p.round > first.round, timeout=5)
    assert second.worker_ids() == ("a/w0", "a/w1", "b/w0", "b/w1", "d/w0", "d/w1")
    assert second.lost == ()
    local.leave("c")

    # The member holding rank 0 (started first: the coordinator) just deletes its key.
    assert local.leader() is local.by_id["a"]
    local.leave("a")
    third = local.wait_for_plan("d", lambda p: p.round > second.round, timeout=5)
    assert third.worker_ids() == ("b/w0", "b/w1", "d/w0", "d/w1")
    assert third.rank_of("b/w0") == 0 and third.round == second.round + 1
    # A bare leave() cannot be told apart from a crash by the coordinator: the workers
    # still in the plan are reported lost, so their ring partners abort at once.
    assert third.lost == ("a/w0", "a/w1")
    assert wait_until(lambda: local.leader() is not None, timeout=5), "no coordinator after the leaves"


@pytest.mark.parametrize("killed_role", ["follower", "coordinator"])
def test_sigkilled_member_is_dropped_within_ttl_plus_one_second(killed_role, processes, local, etcd, job_id):
    ttl = 2.0
    settings = RendezvousSettings(2, 8, settle=0.2, timeout=30)
    keys = JobKeys(job_id)
    if killed_role == "coordinator":  # the first member to start wins the election
        processes.spawn("victim", min_np=2, max_np=8, settle=0.2, ttl=ttl)
        processes.wait_registered("victim")
        assert wait_until(lambda: etcd.get(keys.coordinator) is not None, timeout=5)
        local.add("a", settings)
        local.add("b", settings)
    else:
        local.add("a", settings)
        local.add("b", settings)
        processes.spawn("victim", min_np=2, max_np=8, settle=0.2, ttl=ttl)
        processes.wait_registered("victim")
    assert etcd.get(keys.coordinator).value.decode() == ("victim" if killed_role == "coordinator" else "a")
    full = local.wait_for_plan("a", lambda p: set(p.worker_ids()) == {"a/w0", "b/w0", "victim/w0"})

    processes.kill("victim")
    killed = time.monotonic()
    assert wait_until(lambda: etcd.get(keys.member("victim")) is None, timeout=ttl + 3, interval=0.05)
    key_gone = time.monotonic() - killed
    after = local.wait_for_plan("a", lambda p: p.round > full.round, timeout=ttl + 3)
    plan_seen = time.monotonic() - killed
    assert "victim/w0" not in after.worker_ids()
    assert after.worker_ids() == tuple(w for w in full.worker_ids() if w != "victim/w0")
    assert after.lost == ("victim/w0",)  # no graceful leave: its ring partners must abort
    assert key_gone <= ttl + 1.0, key_gone
    assert plan_seen <= ttl + 1.0 + 0.5, plan_seen


# ----------------------------------------------------------------------------- tests: joining, spares, min_np


def test_joiner_is_appended_after_settle_and_spare_waits_for_a_free_slot(no_leaked_threads, local):
    settle = 0.5
    settings = RendezvousSettings(2, 4, settle=settle, timeout=30)
    local.add("a", settings)
    local.add("b", settings)
    first = local.wait_for_plan("a", has_workers("a/w0", "b/w0"))

    joining = time.monotonic()
    local.add("c", settings)
    second = local.wait_for_plan("a", lambda p: p.round > first.round, timeout=5)
    waited = time.monotonic() - joining
    assert second.worker_ids() == ("a/w0", "b/w0", "c/w0")  # appended, the others keep their ranks
    assert waited >= settle, f"round formed {waited:.3f}s after the join, inside the {settle}s settle window"

    local.add("d", settings)  # max_np reached: closes without settling
    third = local.wait_for_plan("a", lambda p: p.round > second.round, timeout=5)
    assert third.worker_ids() == ("a/w0", "b/w0", "c/w0", "d/w0")

    local.add("e", settings)  # beyond max_np: a spare
    assert not local.by_id["e"].control.wait_for(lambda p, s: p is not None and p.round > third.round,
                                                 timeout=2 * settle)
    assert local.by_id["e"].control.plan.rank_of("e/w0") is None

    local.leave("b")
    # The survivors re-form at once; the spare, yet to start, joins in the round after.
    fourth = local.wait_for_plan("e", lambda p: p.rank_of("e/w0") is not None, timeout=5)
    assert fourth.worker_ids() == ("a/w0", "c/w0", "d/w0", "e/w0")


def test_below_min_np_the_job_fails_after_the_timeout_with_a_clear_message(local, etcd, job_id):
    timeout = 1.0
    started = time.monotonic()
    local.add("alone", RendezvousSettings(2, 4, settle=0.1, timeout=timeout))
    with pytest.raises(RendezvousClosedError, match=r"only 1 of min_np=2"):
        local.wait_for_plan("alone", lambda plan: True, timeout=10)
    elapsed = time.monotonic() - started
    assert timeout <= elapsed < timeout + 3, elapsed
    status = json.loads(etcd.get(JobKeys(job_id).status).value)
    assert status["state"] == FAILED and "only 1 of min_np=2" in status["reason"]
    assert rounds_in_etcd(etcd, JobKeys(job_id)) == {}


# ----------------------------------------------------------------------------- tests: etcd trouble, isolation


def test_members_survive_an_etcd_kill_and_restart_and_the_next_round_forms(fresh_etcd, job_id):
    members = LocalMembers(fresh_etcd.config(), job_id)
    try:
        settings = RendezvousSettings(2, 8, settle=0.2, timeout=60)
        members.add("a", settings)
        members.add("b", settings)
        first = members.wait_for_plan("a", has_workers("a/w0", "b/w0"))
        with Etcd(fresh_etcd.config()) as probe:
            before = {m: probe.get(members.keys.member(m)).create_revision for m in ("a", "b")}

        fresh_etcd.kill()
        fresh_etcd.restart()

        members.add("c", settings)
        after = members.wait_for_plan("a", lambda p: p.round > first.round, timeout=20)
        assert after.worker_ids() == ("a/w0", "b/w0", "c/w0")
        assert members.wait_for_plan("c", lambda p: p.round == after.round, timeout=10) == after
        with Etcd(fresh_etcd.config()) as probe:
            # The same keys on the same leases: membership was kept, not re-created.
            assert {m: probe.get(members.keys.member(m)).create_revision for m in ("a", "b")} == before
        assert not any(p.session.lost.is_set() for p in members.by_id.values())
    finally:
        members.close()


def test_two_jobs_on_one_etcd_do_not_see_each_other(etcd_server, etcd, job_id):
    # The second id extends the first: a prefix without its trailing "/" would leak.
    jobs = {job_id: LocalMembers(etcd_server.config(), job_id),
            job_id + "-b": LocalMembers(etcd_server.config(), job_id + "-b")}
    try:
        seen: dict[str, set[str]] = {j: set() for j in jobs}
        settings = RendezvousSettings(2, 2, settle=0.1, timeout=30)
        for job, group in jobs.items():
            for name in ("x", "y"):  # the same member ids in both jobs
                participant = group.add(name, settings)
                participant.control.add_listener(
                    lambda plan, status, job=job: plan and seen[job].update(plan.worker_ids()))
        for job, group in jobs.items():
            plan = group.wait_for_plan("x", has_workers("x/w0", "y/w0"))
            assert plan.round == 1
            assert list(rounds_in_etcd(etcd, group.keys)) == [1]
        assert seen == {j: {"x/w0", "y/w0"} for j in jobs}
        kvs, _ = etcd.get_prefix(jobs[job_id].keys.prefix)
        assert all(kv.key.startswith(f"/elastic/{job_id}/") for kv in kvs)
        assert not any(kv.key.startswith(f"/elastic/{job_id}-b/") for kv in kvs)
        assert all(g.leader() is not None for g in jobs.values())  # one coordinator per job
    finally:
        for group in jobs.values():
            group.close()


def test_only_the_coordinator_watches_the_members_prefix(no_leaked_threads, local):
    settings = RendezvousSettings(2, 8, settle=0.2, timeout=30)
    names = ["a", "b", "c", "d"]
    for name in names:
        local.add(name, settings)
    plan = local.wait_for_plan("d", has_workers(*(worker(m) for m in names)))
    leader = wait_until(local.leader, timeout=5)
    assert leader is not None

    def members_watches(participant: Participant) -> int:
        return sum(1 for w in list(participant.etcd._watches) if w.key == local.keys.members and w.active)

    assert {m: members_watches(p) for m, p in local.by_id.items()} == \
        {m: int(p is leader) for m, p in local.by_id.items()}
    # Every member follows the control prefix: one event per member per round.
    assert all(any(w.key == local.keys.control and w.active for w in list(p.etcd._watches))
               for p in local.by_id.values())

    # A join costs the followers no etcd requests beyond their own keep-alives.
    before = {m: p.etcd.requests for m, p in local.by_id.items()}
    local.add("e", settings)
    local.wait_for_plan("a", lambda p: p.round > plan.round, timeout=5)
    for name in names:
        spent = local.by_id[name].etcd.requests - before[name]
        if local.by_id[name] is leader:
            assert spent <= 10, f"coordinator sent {spent} requests for one round"
        else:
            assert spent <= 2, f"follower {name} sent {spent} requests while another member joined"
