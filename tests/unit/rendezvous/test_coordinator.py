"""The coordinator's leader loop on an in-memory etcd (tests/fakes/kv.py): snapshot ->
decide -> apply, with no server and no worker process. What a real etcd adds (watches
that break and resume, compaction, two processes) is tested in
tests/integration/test_coordinator_*.py."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from elastic.rendezvous.control import ControlChannel
from elastic.rendezvous.coordinator import Coordinator
from elastic.rendezvous.keys import JobKeys
from elastic.rendezvous.rounds import Member, RendezvousSettings
from tests.fakes.kv import MemoryKv

pytestmark = pytest.mark.timeout(30)

KEYS = JobKeys("unit")


class Session:
    """What the coordinator reads of its etcd session: a lease, and whether it is lost."""

    def __init__(self, kv: MemoryKv, ttl: float = 5.0):
        self.lease_id = kv.grant_lease(ttl)
        self.ttl = ttl
        self.lost = threading.Event()
        self.back_at = None


class Agent:
    """A member key, a session, a control channel and a coordinator: an agent's rendezvous."""

    def __init__(self, kv: MemoryKv, name: str, workers: tuple[str, ...], settings: RendezvousSettings,
                 store_port: int = 1):
        self.name, self.kv = name, kv
        self.session = Session(kv)
        member = Member(name, "h" + name, "127.0.0.1", store_port, workers, 0.0)
        kv.put(KEYS.member(name), member.to_json(), lease=self.session.lease_id)
        self.control = ControlChannel(kv, KEYS).start()
        self.coordinator = Coordinator(kv, KEYS, self.session, settings, name, self.control).start()

    def close(self) -> None:
        self.coordinator.stop()
        self.control.close()


@pytest.fixture
def kv():
    store = MemoryKv()
    yield store
    store.close()


def plan_of(control: ControlChannel, round_number: int, timeout: float = 10.0):
    assert control.wait_for(lambda p, s: p is not None and p.round >= round_number, timeout=timeout), control.plan
    return control.plan


def plan_with(control: ControlChannel, workers: int, timeout: float = 10.0):
    """The first plan that ranks ``workers`` workers (agents start one after the other)."""
    assert control.wait_for(lambda p, s: p is not None and len(p.slots) == workers, timeout=timeout), control.plan
    return control.plan


def refusing_port() -> int:
    """A local port nothing listens on: a connection to it is refused (a dead agent)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_leader_forms_the_first_round_of_the_members_present(kv):
    settings = RendezvousSettings(min_np=2, max_np=2, settle=0.0)
    agents = [Agent(kv, "a", ("a0",), settings), Agent(kv, "b", ("b0",), settings)]
    try:
        plan = plan_of(agents[0].control, 1)
        assert sorted(plan.worker_ids()) == ["a0", "b0"] and plan.round == 1
        assert sum(a.coordinator.leading.is_set() for a in agents) == 1
        assert plan_of(agents[1].control, 1) == plan  # every agent reads the one plan
    finally:
        for agent in agents:
            agent.close()


def test_a_member_whose_lease_expired_is_left_out_of_the_next_round_as_lost(kv):
    settings = RendezvousSettings(min_np=1, max_np=2, settle=0.0)
    a, b = Agent(kv, "a", ("a0",), settings), Agent(kv, "b", ("b0",), settings)
    try:
        full = plan_with(a.control, 2)
        survivor, victim = (a, b) if a.coordinator.leading.is_set() else (b, a)
        kv.expire(victim.session.lease_id)
        plan = plan_of(survivor.control, full.round + 1)
        assert plan.worker_ids() == (survivor.name + "0",)
        assert plan.lost == (victim.name + "0",) and plan.recovers and plan.reason == "1 worker(s) lost"
    finally:
        a.close()
        b.close()


def test_when_the_leaders_lease_expires_another_agent_leads_and_forms_the_round(kv):
    settings = RendezvousSettings(min_np=1, max_np=3, settle=0.0)
    agents = {n: Agent(kv, n, (n + "0",), settings) for n in "abc"}
    try:
        first = plan_with(agents["a"].control, 3)
        leader = next(a for a in agents.values() if a.coordinator.leading.is_set())
        leader.session.lost.set()  # its agent is cut off from etcd: it stops leading
        kv.expire(leader.session.lease_id)  # and its keys go, the election key included
        others = [a for a in agents.values() if a is not leader]
        plan = plan_of(others[0].control, first.round + 1)
        assert sorted(plan.worker_ids()) == sorted(a.name + "0" for a in others)
        # The old leader stops leading on its next turn (at most a second): one leader then.
        deadline = time.monotonic() + 5
        while leader.coordinator.leading.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not leader.coordinator.leading.is_set()
        assert sum(a.coordinator.leading.is_set() for a in others) == 1
    finally:
        for agent in agents.values():
            agent.close()


def test_an_unexplained_broken_ring_evicts_the_dead_agent_before_the_round(kv):
    settings = RendezvousSettings(min_np=1, max_np=3, settle=0.0, reset_grace=0.05)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        a = Agent(kv, "a", ("a0",), settings, store_port=listener.getsockname()[1])
        plan_of(a.control, 1)  # a alone leads
        b = Agent(kv, "b", ("b0",), settings, store_port=listener.getsockname()[1])  # alive
        c = Agent(kv, "c", ("c0",), settings, store_port=refusing_port())  # its agent is dead
        plan = plan_with(a.control, 3)
        assert a.coordinator.leading.is_set()
        # The ring breaks and nobody says why (c's lease would live for its TTL).
        a.control.request_reset("a0", plan.round, "gloo: connection reset")
        after = plan_of(a.control, plan.round + 1)
        assert sorted(after.worker_ids()) == ["a0", "b0"], after
        assert after.lost == ("c0",)
        assert kv.get(KEYS.member("c")) is None and kv.get(KEYS.member("b")) is not None
        for agent in (a, b, c):
            agent.close()
    finally:
        listener.close()


def test_a_malformed_member_key_is_skipped_and_the_round_forms(kv):
    settings = RendezvousSettings(min_np=2, max_np=3, settle=0.0)
    kv.put(KEYS.member("junk"), b"{not json")
    agents = [Agent(kv, "a", ("a0",), settings), Agent(kv, "b", ("b0",), settings)]
    try:
        assert sorted(plan_of(agents[0].control, 1).worker_ids()) == ["a0", "b0"]
    finally:
        for agent in agents:
            agent.close()


def test_below_min_np_past_the_timeout_the_leader_fails_the_job(kv):
    settings = RendezvousSettings(min_np=2, max_np=2, settle=0.0, timeout=0.2)
    a = Agent(kv, "a", ("a0",), settings)
    try:
        assert a.control.wait_for(lambda p, s: s.over, timeout=10.0)
        assert "only 1 of min_np=2 workers present" in a.control.status.reason
        assert a.control.plan is None
    finally:
        a.close()
