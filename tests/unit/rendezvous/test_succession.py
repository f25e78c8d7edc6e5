"""A survivor whose ring broke takes over from a dead coordinator at once (succession.py):
the decision as a table, then the check on an in-memory etcd with real coordinators."""

from __future__ import annotations

import pytest

from elastic.rendezvous.liveness import ACCEPTED, REFUSED, SILENT
from elastic.rendezvous.rounds import RendezvousSettings
from elastic.rendezvous.reachability import ReachReport
from elastic.rendezvous.succession import (CALL_DEADLINE_S, DONE, EVICT, OWN_REPORT_WAIT_S, PROBE, RETRY, Succession,
                                           SuccessionView, next_move)
from tests.unit.rendezvous.test_coordinator import KEYS, Agent, kv, plan_of, plan_with, refusing_port  # noqa: F401

pytestmark = pytest.mark.timeout(30)


def view(failed=4, plan=4, leader="lead", me="me", answer=None, elapsed=0.5, patience=8.0, cut_off_for=None):
    return SuccessionView(failed, plan, leader, me, answer, elapsed, patience, cut_off_for)


@pytest.mark.parametrize("case, expected", [
    (view(), PROBE),  # the ring broke, no round yet, somebody else leads: ask its agent
    (view(answer=REFUSED), EVICT),  # its host is up, its agent gone: proof of death
    (view(answer=ACCEPTED), DONE),  # alive: planning the round is its job
    (view(answer=SILENT), RETRY),  # no answer: no proof (the partition may be ours); look again
    # Silent, and its whole ring named it while it reported nothing: once its own report
    # had time to come, it is dead or cut off from everything.
    (view(answer=SILENT, cut_off_for=0.0), RETRY),
    (view(answer=SILENT, cut_off_for=OWN_REPORT_WAIT_S), EVICT),
    (view(answer=ACCEPTED, cut_off_for=5.0), DONE),  # it answers us: alive, whatever the others say
    (view(answer=SILENT, cut_off_for=5.0, elapsed=8.0), DONE),
    (view(answer=SILENT, elapsed=8.0), DONE),  # two TTLs on: its lease has decided by now
    (view(answer=REFUSED, elapsed=8.0), DONE),
    (view(plan=5, answer=REFUSED), DONE),  # a round answered the failure: a coordinator is at work
    (view(leader=None), DONE),  # vacant: every agent campaigns already
    (view(leader="me", answer=REFUSED), DONE),  # we lead: our own coordinator answers
])
def test_next_move(case, expected):
    assert next_move(case) == expected


class _Answers:
    """The leader's agent's answer, fixed by the test; counts the connects."""

    def __init__(self, answer):
        self.answer, self.asked = answer, 0

    def __call__(self, addr, port, timeout):
        self.asked += 1
        return self.answer


def _three_agents(kv, dead_port):
    settings = RendezvousSettings(min_np=1, max_np=3, settle=0.0, reset_grace=0.05)
    a = Agent(kv, "a", ("a0",), settings, store_port=dead_port)
    plan_of(a.control, 1)  # a alone: it leads
    agents = [a, Agent(kv, "b", ("b0",), settings), Agent(kv, "c", ("c0",), settings)]
    plan = plan_with(a.control, 3)
    assert a.coordinator.leading.is_set()
    a.coordinator.stop()  # a's host is lost: its coordinator is gone, its lease (TTL 5 s, never expired here) stays
    a.control.close()
    return agents, plan


class _Deadlines:
    """The kv, recording the retry deadline of every call the succession makes."""

    def __init__(self, kv):
        self._kv, self.seen = kv, []

    def get(self, key, **kwargs):
        self.seen.append(kwargs.get("retry_deadline"))
        return self._kv.get(key)

    def get_prefix(self, prefix, **kwargs):
        self.seen.append(kwargs.get("retry_deadline"))
        return self._kv.get_prefix(prefix)

    def revoke_lease(self, lease_id, **kwargs):
        self.seen.append(kwargs.get("retry_deadline"))
        return self._kv.revoke_lease(lease_id)


def test_a_coordinator_whose_agent_refuses_is_replaced_before_its_ttl(kv):
    agents, plan = _three_agents(kv, refusing_port())
    b = agents[1]
    calls = _Deadlines(kv)
    succession = Succession(calls, KEYS, "b", lambda: b.control.plan, patience=10.0).start()
    try:
        succession.ring_broke(plan.round)  # b's worker saw the ring break
        after = plan_of(b.control, plan.round + 1)
        assert sorted(after.worker_ids()) == ["b0", "c0"] and after.lost == ("a0",)
        assert kv.get(KEYS.member("a")) is None  # its lease went, member record and election key with it
        assert sum(x.coordinator.leading.is_set() for x in agents[1:]) == 1
        # Every call one short try: etcd may be electing a new leader (the coordinator's
        # host held it), and a call sent then waits for its whole timeout otherwise.
        # (the key, the leader's record, the ring's reports, the revocation)
        assert len(calls.seen) == 4 and set(calls.seen) == {CALL_DEADLINE_S}
    finally:
        succession.stop()
        for agent in agents:
            agent.close()


@pytest.mark.parametrize("answer", [ACCEPTED, SILENT])
def test_a_coordinator_that_answers_or_gives_no_proof_keeps_its_key(kv, answer):
    agents, plan = _three_agents(kv, refusing_port())
    b = agents[1]
    answers = _Answers(answer)
    succession = Succession(kv, KEYS, "b", lambda: b.control.plan, patience=1.2, answer=answers)
    try:
        # Called in this thread: returns once there is nothing left to do (2 TTLs at most).
        assert succession.check(plan.round, since=succession._clock()) == DONE
        assert kv.get(KEYS.coordinator).value == b"a" and kv.get(KEYS.member("a")) is not None
        assert b.control.plan.round == plan.round  # nobody took over: a's TTL decides
        # Accepted: asked once. Silent: asked again every half second until the TTLs ran out.
        assert answers.asked == 1 if answer == ACCEPTED else answers.asked >= 2
    finally:
        for agent in agents:
            agent.close()


def test_a_silent_coordinator_its_whole_ring_reports_unreachable_is_replaced_before_its_ttl(kv):
    """Its host died hard: connects time out, nothing refuses. b's and c's probes named
    it in the round; it reported nothing: b deposes it without waiting for its TTL."""
    agents, plan = _three_agents(kv, refusing_port())
    b = agents[1]
    answers = _Answers(SILENT)
    succession = Succession(kv, KEYS, "b", lambda: b.control.plan, patience=10.0, answer=answers)
    try:
        kv.put(KEYS.reach_report("b"), ReachReport("b", plan.round, ("a",)).to_json())
        started = succession._clock()
        # Only b has named it: no evidence yet; c's report comes while b looks again.
        assert succession._look(plan.round, started) == RETRY
        kv.put(KEYS.reach_report("c"), ReachReport("c", plan.round, ("a",)).to_json())
        assert succession.check(plan.round, since=started) == EVICT
        assert succession._clock() - started >= OWN_REPORT_WAIT_S  # a live one's own report was waited for
        after = plan_of(b.control, plan.round + 1)
        assert sorted(after.worker_ids()) == ["b0", "c0"] and after.lost == ("a0",)
        assert kv.get(KEYS.member("a")) is None
    finally:
        for agent in agents:
            agent.close()


def test_a_silent_coordinator_that_reports_itself_keeps_its_key(kv):
    """Alive and reaching etcd: it reported in the round (it will decide for itself), so
    its silence to b and c is no reason to depose it."""
    agents, plan = _three_agents(kv, refusing_port())
    b = agents[1]
    succession = Succession(kv, KEYS, "b", lambda: b.control.plan, patience=1.2, answer=_Answers(SILENT))
    try:
        for member, unreachable in (("b", ("a",)), ("c", ("a",)), ("a", ("b", "c"))):
            kv.put(KEYS.reach_report(member), ReachReport(member, plan.round, unreachable).to_json())
        assert succession.check(plan.round, since=succession._clock()) == DONE  # patience ran out
        assert kv.get(KEYS.coordinator).value == b"a" and kv.get(KEYS.member("a")) is not None
    finally:
        for agent in agents:
            agent.close()
