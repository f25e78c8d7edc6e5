"""Table tests of the pure round decider: no etcd, no clock."""

import pytest

from elastic.rendezvous.errors import ConfigError
from elastic.rendezvous.rounds import (
    Fail,
    FormRound,
    Member,
    ProbeLiveness,
    ResetRequest,
    RendezvousSettings,
    RoundPlan,
    Slot,
    CoordinatorView,
    StopJob,
    Wait,
    candidate_count,
    candidates,
    decide,
)

S = RendezvousSettings(min_np=2, max_np=4, settle=0.5, timeout=10.0, reset_grace=0.3)


def member(mid, workers, revision):
    return Member(mid, "h" + mid, "127.0.0.1", 1000, tuple(workers), 0.0, revision)


def plan(round_, *pairs):
    slots = tuple(Slot(m, w) for m, w in pairs)
    hosts = {m: ("h" + m, "127.0.0.1") for m, _ in pairs}
    return RoundPlan(round_, slots, hosts, "127.0.0.1:1000", 0.0)


def workers(decision):
    assert isinstance(decision, FormRound), decision
    return [s.worker_id for s in decision.slots]


def test_first_round_waits_for_settle_then_forms():
    snap = CoordinatorView(None, (member("a", ["a0"], 1), member("b", ["b0"], 2)), last_change=5.0)
    assert decide(snap, S, now=5.1) == Wait(5.5, "settling")
    assert workers(decide(snap, S, now=5.5)) == ["a0", "b0"]


def test_first_round_forms_at_once_at_max_np():
    snap = CoordinatorView(None, (member("a", ["a0", "a1"], 1), member("b", ["b0", "b1"], 2)), last_change=5.0)
    assert workers(decide(snap, S, now=5.0)) == ["a0", "a1", "b0", "b1"]


def test_below_min_waits_then_fails_naming_the_count():
    snap = CoordinatorView(None, (member("a", ["a0"], 1),), below_min_since=0.0)
    assert isinstance(decide(snap, S, now=9.9), Wait)
    failed = decide(snap, S, now=10.0)
    assert isinstance(failed, Fail)
    assert "only 1 of min_np=2" in failed.reason


def test_join_order_follows_member_revision_not_name():
    snap = CoordinatorView(None, (member("z", ["z0"], 1), member("a", ["a0"], 7)), last_change=0.0)
    assert workers(decide(snap, S, now=1.0)) == ["z0", "a0"]


def test_loss_forms_at_once_and_survivors_keep_order():
    p = plan(3, ("a", "a0"), ("b", "b0"), ("c", "c0"))
    snap = CoordinatorView(p, (member("a", ["a0"], 1), member("c", ["c0"], 3)), last_change=9.0)
    assert workers(decide(snap, S, now=9.0)) == ["a0", "c0"]


def test_losing_rank0_makes_the_longest_lived_survivor_rank0():
    p = plan(3, ("a", "a0"), ("b", "b0"), ("c", "c0"))
    # c re-registered earlier than b would suggest: the plan order, not revision, decides
    snap = CoordinatorView(p, (member("c", ["c0"], 1), member("b", ["b0"], 2)), last_change=9.0)
    assert workers(decide(snap, S, now=9.0)) == ["b0", "c0"]


def test_newcomers_are_appended_after_settle():
    p = plan(1, ("a", "a0"), ("b", "b0"))
    snap = CoordinatorView(p, (member("n", ["n0"], 1), member("a", ["a0"], 2), member("b", ["b0"], 3)), last_change=4.0)
    assert decide(snap, S, now=4.2) == Wait(4.5, "settling joiners")
    assert workers(decide(snap, S, now=4.5)) == ["a0", "b0", "n0"]


def test_spares_beyond_max_np_wait_and_are_admitted_after_a_leave():
    p = plan(1, ("a", "a0"), ("a", "a1"), ("b", "b0"), ("b", "b1"))
    full = (member("a", ["a0", "a1"], 1), member("b", ["b0", "b1"], 2), member("s", ["s0"], 3))
    assert decide(CoordinatorView(p, full, last_change=1.0), S, now=5.0) == Wait(None, "membership unchanged")
    after_leave = (member("a", ["a0", "a1"], 1), member("b", ["b0"], 2), member("s", ["s0"], 3))
    # The survivors re-form at once without the spare (it has yet to start) ...
    assert workers(decide(CoordinatorView(p, after_leave, last_change=6.0), S, now=6.0)) == ["a0", "a1", "b0"]
    # ... which joins in the next round, at a commit, like any joiner.
    p2 = plan(2, ("a", "a0"), ("a", "a1"), ("b", "b0"))
    assert workers(decide(CoordinatorView(p2, after_leave, last_change=6.0), S, now=6.5)) == ["a0", "a1", "b0", "s0"]


def test_a_replacement_worker_joins_after_the_survivors_re_formed():
    # The agent reports the crash and offers a replacement in one update: the loss
    # round must not wait for the replacement to start up.
    p = plan(3, ("a", "a0"), ("a", "a1"), ("b", "b0"))
    replaced = (member("a", ["a0", "a2"], 1), member("b", ["b0"], 2))
    decision = decide(CoordinatorView(p, replaced, last_change=9.0), S, now=9.0)
    assert workers(decision) == ["a0", "b0"] and decision.lost == ("a1",)


def test_newcomers_fill_a_loss_round_only_when_survivors_are_below_min_np():
    p = plan(3, ("a", "a0"), ("b", "b0"))
    ms = (member("a", ["a0"], 1), member("n", ["n0"], 3))
    assert workers(decide(CoordinatorView(p, ms, last_change=9.0), S, now=9.0)) == ["a0", "n0"]


def test_reset_request_waits_for_grace_then_reforms_same_members():
    p = plan(2, ("a", "a0"), ("b", "b0"))
    ms = (member("a", ["a0"], 1), member("b", ["b0"], 2))
    req = (ResetRequest("a0", 2, "gloo timeout", seen_at=7.0),)
    assert isinstance(decide(CoordinatorView(p, ms, req), S, now=7.1), Wait)
    assert workers(decide(CoordinatorView(p, ms, req, leader="a", probed=frozenset({"b"})), S, now=7.3)) == ["a0", "b0"]


def test_stale_reset_request_is_ignored():
    p = plan(2, ("a", "a0"), ("b", "b0"))
    ms = (member("a", ["a0"], 1), member("b", ["b0"], 2))
    req = (ResetRequest("a0", 1, "old", seen_at=0.0),)
    assert decide(CoordinatorView(p, ms, req), S, now=9.0) == Wait(None, "membership unchanged")


def test_plan_json_round_trip():
    p = plan(5, ("a", "a0"), ("b", "b0"), ("a", "a1"))
    q = RoundPlan.from_json(p.to_json())
    assert q == p
    assert q.rank_of("a1") == 2 and q.local_ranks("a") == ["a0", "a1"] and q.member_order() == ["a", "b"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_np=0, max_np=4), "min_np must be at least 1"),
        (dict(min_np=5, max_np=4), "max_np (4) must be at least min_np (5)"),
        (dict(min_np=1, max_np=4, settle=-1), "settle must not be negative"),
    ],
)
def test_settings_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RendezvousSettings(**kwargs)


def test_reset_request_naming_killed_workers_forms_at_once_and_marks_them_lost():
    # Round 3 already excludes "b0" (its host is leaving); the ring of round 2 that the
    # survivors are still in is blocked on it, so the next round must name it lost.
    p = plan(3, ("a", "a0"), ("c", "c0"))
    ms = (member("a", ["a0"], 1), member("c", ["c0"], 3))
    req = (ResetRequest("b.forced", 3, "graceful leave forced", seen_at=7.0, lost=("b0",)),)
    decision = decide(CoordinatorView(p, ms, req), S, now=7.0)
    assert workers(decision) == ["a0", "c0"] and decision.lost == ("b0",)


def draining(mid, revision):
    return Member(mid, "h" + mid, "127.0.0.1", 1000, (), 0.0, revision, draining=True)


def test_leaves_that_would_go_below_min_np_stop_the_job_in_one_place():
    # Two hosts told to leave at once: each alone would leave enough, together not.
    p = plan(2, ("a", "a0"), ("b", "b0"), ("c", "c0"))
    ms = (member("a", ["a0"], 1), draining("b", 2), draining("c", 3))
    decision = decide(CoordinatorView(p, ms), S, now=1.0)
    assert isinstance(decision, StopJob), decision
    assert "below min_np=2" in decision.reason


def test_one_leave_that_keeps_min_np_switches_without_the_leaver():
    p = plan(2, ("a", "a0"), ("b", "b0"), ("c", "c0"))
    ms = (member("a", ["a0"], 1), member("b", ["b0"], 2), draining("c", 3))
    decision = decide(CoordinatorView(p, ms), S, now=1.0)
    assert workers(decision) == ["a0", "b0"] and decision.lost == ()


def test_leaves_seen_apart_are_settled_into_one_decision():
    # Two hosts signalled together whose drain marks reach the coordinator a moment
    # apart: the first is held for the settle window, so both are decided at once.
    p = plan(2, ("a", "a0"), ("b", "b0"), ("c", "c0"))
    one = (member("a", ["a0"], 1), member("b", ["b0"], 2), draining("c", 3))
    assert decide(CoordinatorView(p, one, last_change=1.0), S, now=1.001) == Wait(1.5, "settling leaves")
    both = (member("a", ["a0"], 1), draining("b", 2), draining("c", 3))
    assert isinstance(decide(CoordinatorView(p, both, last_change=1.002), S, now=1.5), StopJob)
    # A crash beside a leave is not held: the survivors are stalled.
    p4 = plan(2, ("a", "a0"), ("a", "a1"), ("b", "b0"), ("c", "c0"))
    crashed = (member("a", ["a0", "a1"], 1), member("b", [], 2), draining("c", 3))
    decision = decide(CoordinatorView(p4, crashed, last_change=1.0), S, now=1.001)
    assert workers(decision) == ["a0", "a1"] and decision.lost == ("b0",)


def test_a_crash_with_a_leave_below_min_np_waits_instead_of_stopping():
    # The ring is broken by the crash: no commit to stop at; wait for workers as before.
    p = plan(2, ("a", "a0"), ("b", "b0"), ("c", "c0"))
    ms = (member("a", ["a0"], 1), draining("c", 3))
    assert isinstance(decide(CoordinatorView(p, ms, below_min_since=1.0), S, now=1.0), Wait)


def test_an_unexplained_broken_ring_probes_the_other_agents_before_its_round_forms():
    p = plan(2, ("a", "a0"), ("b", "b0"), ("c", "c0"))
    ms = (member("a", ["a0"], 1), member("b", ["b0"], 2), member("c", ["c0"], 3))
    req = (ResetRequest("a0", 2, "gloo timeout", seen_at=7.0),)
    # The leader (a) is alive by deciding; b and c are probed first.
    assert decide(CoordinatorView(p, ms, req, leader="a"), S, now=7.3) == ProbeLiveness(("b", "c"))
    # Their answers come back: the round forms with whoever is left.
    formed = decide(CoordinatorView(p, ms, req, leader="a", probed=frozenset({"b", "c"})), S, now=7.3)
    assert workers(formed) == ["a0", "b0", "c0"] and formed.recovers
    assert decide(CoordinatorView(p, ms, req, leader="a", probed=frozenset({"b"})), S, now=7.3) == ProbeLiveness(("c",))
    # A reset request that names its dead needs no probe; a join never does.
    told = (ResetRequest("a0", 2, "gloo timeout", seen_at=7.0, lost=("c0",)),)
    assert isinstance(decide(CoordinatorView(p, ms, told, leader="a"), S, now=7.0), FormRound)
    joined = (*ms, member("n", ["n0"], 4))
    assert isinstance(decide(CoordinatorView(p, joined, last_change=0.0, leader="a"), S, now=7.3), FormRound)


@pytest.mark.parametrize("excluded, reason", [
    (frozenset(), "1 worker(s) lost"),
    (frozenset({"b"}), "1 worker(s) lost: b unreachable from the ring"),
    (frozenset({"x"}), "1 worker(s) lost"),  # excluded, but it held no rank
])
def test_a_loss_on_a_member_cut_off_from_the_ring_says_so(excluded, reason):
    p = plan(2, ("a", "a0"), ("b", "b0"), ("c", "c0"))
    ms = (member("a", ["a0"], 1), member("c", ["c0"], 3))
    decision = decide(CoordinatorView(p, ms, excluded=excluded), S, now=1.0)
    assert decision.reason == reason and decision.lost == ("b0",)


def test_a_replacement_waits_until_the_survivors_formed_their_round_or_had_time_to():
    # Round 4 re-formed a broken ring without the dead a1; the agent offers a2 at once.
    # A join round now would make the survivors, still forming round 4, abandon it for
    # one that waits seconds for a2 to start: it comes after recovery_hold instead.
    survivors = RoundPlan(4, (Slot("a", "a0"), Slot("b", "b0")), {"a": ("ha", "x"), "b": ("hb", "x")},
                          "x:1", 0.0, lost=("a1",), recovers=True)
    offered = (member("a", ["a0", "a2"], 1), member("b", ["b0", "b1"], 2))  # 4 = max_np: no settle
    held = decide(CoordinatorView(survivors, offered, last_change=10.0, plan_seen_at=10.0), S, now=10.1)
    assert held == Wait(10.0 + S.recovery_hold, "letting the survivors form their round first")
    assert workers(decide(CoordinatorView(survivors, offered, last_change=10.0, plan_seen_at=10.0), S,
                          now=10.0 + S.recovery_hold)) == ["a0", "b0", "a2", "b1"]
    # A survivor on the coordinator's host says their round formed: the hold ends then.
    assert workers(decide(CoordinatorView(survivors, offered, last_change=10.0, plan_seen_at=10.0, plan_formed=True),
                          S, now=10.1)) == ["a0", "b0", "a2", "b1"]
    # A join after a round that did not re-form a broken ring is not held.
    grown = RoundPlan(4, survivors.slots, survivors.hosts, "x:1", 0.0)
    assert workers(decide(CoordinatorView(grown, offered, last_change=10.0, plan_seen_at=10.0), S, now=10.1)) == [
        "a0", "b0", "a2", "b1"]
    # Nor is another failure during the hold: b0 dies too.
    failed_again = (member("a", ["a0", "a2"], 1), member("b", ["b1"], 2))
    decision = decide(CoordinatorView(survivors, failed_again, last_change=10.0, plan_seen_at=10.0), S, now=10.1)
    assert decision.lost == ("b0",) and decision.recovers


def test_rounds_that_re_form_a_broken_ring_say_so_and_carry_their_reason():
    p = plan(3, ("a", "a0"), ("a", "a1"), ("b", "b0"))
    lost = decide(CoordinatorView(p, (member("a", ["a0"], 1), member("b", ["b0"], 2)), last_change=1.0), S, now=1.0)
    assert lost.recovers and lost.reason == "1 worker(s) lost"
    requested = decide(CoordinatorView(p, (member("a", ["a0", "a1"], 1), member("b", ["b0"], 2)),
                                (ResetRequest("a0", 3, "gloo timeout", seen_at=1.0),), leader="a",
                                probed=frozenset({"b"})), S, now=2.0)
    assert requested.recovers and requested.reason == "reset requested: gloo timeout"
    q = RoundPlan(4, p.slots, p.hosts, "x:1", 0.0, reason="1 worker(s) lost", recovers=True)
    assert RoundPlan.from_json(q.to_json()) == q


@pytest.mark.parametrize("previous, members", [
    (None, ()),
    (None, (member("a", ["a0", "a1"], 1), member("b", ["b0"], 2))),
    # survivors, a worker gone, a newcomer, a member with no workers (draining)
    (plan(3, ("a", "a0"), ("b", "b0"), ("b", "b1")), (member("a", ["a0"], 1), member("b", ["b1"], 2),
                                                      member("c", ["c0", "c1"], 3), member("d", [], 4))),
    # a worker id now offered by another member than in the plan
    (plan(2, ("a", "x0")), (member("b", ["x0"], 2), member("a", ["a1"], 1))),
])
def test_the_cheap_candidate_count_is_the_number_of_candidates(previous, members):
    assert candidate_count(members) == len(candidates(previous, members))


# After an etcd outage (the coordinator's own refreshes failed until t=20, TTL 10: renew
# until 30), a host whose lease expired meanwhile but whose workers still train is given
# the window to renew; a real loss is not.
RING = plan(3, ("a", "a0"), ("b", "b0"), ("c", "c0"))
AB = (member("a", ["a0"], 1), member("b", ["b0"], 2))


@pytest.mark.parametrize("what, members, requests, renew_until, now, expected", [
    ("expired lease, ring intact: wait", AB, (), 30.0, 21.0, Wait(30.0, "etcd was away: members whose lease expired may still renew")),
    ("the window is over: lost", AB, (), 30.0, 30.0, ["a0", "b0"]),
    ("no outage: lost at once", AB, (), None, 21.0, ["a0", "b0"]),
    ("the ring broke: lost at once", AB, (ResetRequest("a0", 3, "peer died", 20.5),), 30.0, 21.0, ["a0", "b0"]),
    ("a request of an older round does not count", AB, (ResetRequest("a0", 2, "old", 20.5),), 30.0, 21.0,
     Wait(30.0, "etcd was away: members whose lease expired may still renew")),
    ("its agent withdrew the worker (a crash): lost at once",
     AB + (member("c", [], 3),), (), 30.0, 21.0, ["a0", "b0"]),
    ("the member renewed: nothing lost", AB + (member("c", ["c0"], 9),), (), 30.0, 21.0,
     Wait(None, "membership unchanged")),
])
def test_after_an_etcd_outage_an_expired_member_may_renew_before_it_counts_as_lost(
        what, members, requests, renew_until, now, expected):
    snap = CoordinatorView(RING, members, requests=requests, last_change=20.0, renew_until=renew_until)
    decision = decide(snap, S, now=now)
    if isinstance(expected, list):
        assert workers(decision) == expected, what
        assert decision.lost == ("c0",), what
    else:
        assert decision == expected, what
