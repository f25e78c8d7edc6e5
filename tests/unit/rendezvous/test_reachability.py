"""Table tests of the pure reachability decision (rendezvous.reachability.exclusions)."""

import pytest

from elastic.rendezvous.reachability import Exclusion, ReachReport, cut_off_from_its_ring, exclusions
from elastic.rendezvous.rounds import RoundPlan, Slot


def ring(round_, *members):
    """A plan with one worker per member, ranks in the order given."""
    slots = tuple(Slot(m, f"{m}.w0") for m in members)
    return RoundPlan(round_, slots, {m: (m, "10.0.0.1") for m in members}, "10.0.0.1:1", 0.0)


def rep(member, round_, *unreachable, at=0.0):
    return ReachReport(member, round_, tuple(unreachable), at)


def reports(*items):
    return {r.member_id: r for r in items}


ABC = ring(5, "a", "b", "c")


@pytest.mark.parametrize("plan, registered, given, now, excluded", [
    # Nobody reports anything, or everything reachable: nobody goes.
    (ABC, "abc", reports(), 0.0, set()),
    (ABC, "abc", reports(rep("a", 5), rep("b", 5), rep("c", 5)), 0.0, set()),
    # c cut from its peers, all three say so: c goes (the test's case).
    (ABC, "abc", reports(rep("a", 5, "c"), rep("b", 5, "c"), rep("c", 5, "a", "b")), 0.0, {"c"}),
    # The same when rank 0's host is the one cut off: it goes, b and c stay.
    (ABC, "abc", reports(rep("a", 5, "b", "c"), rep("b", 5, "a"), rep("c", 5, "a")), 0.0, {"a"}),
    # Only the cut host reported so far, grace over: its pairs decide alone.
    (ABC, "abc", reports(rep("c", 5, "a", "b")), 2.0, {"c"}),
    # One broken pair (a-b) and nobody else involved: one of them must go; the
    # later rank (b), so rank 0's host stays.
    (ABC, "abc", reports(rep("a", 5, "b"), rep("b", 5), rep("c", 5)), 0.0, {"b"}),
    # Reports of an earlier round are about a ring that is gone: ignored.
    (ABC, "abc", reports(rep("a", 4, "c"), rep("b", 4, "c"), rep("c", 4, "a", "b")), 0.0, set()),
    # A refusing/unknown name (not in the ring) is not a pair of the ring.
    (ABC, "abc", reports(rep("a", 5, "zz"), rep("b", 5), rep("c", 5)), 0.0, set()),
    # Nobody reaches anybody: no half of the ring reaches itself; nobody goes.
    (ABC, "abc", reports(rep("a", 5, "b", "c"), rep("b", 5, "a", "c"), rep("c", 5, "a", "b")), 0.0, set()),
    # Two against two, all cross pairs broken: the side holding rank 0 stays.
    (ring(5, "a", "b", "c", "d"), "abcd",
     reports(rep("a", 5, "c", "d"), rep("b", 5, "c", "d"), rep("c", 5, "a", "b"), rep("d", 5, "a", "b")),
     0.0, {"c", "d"}),
    # Three against one in a ring of four where the one is rank 0: the three stay.
    (ring(5, "a", "b", "c", "d"), "abcd",
     reports(rep("a", 5, "b", "c", "d"), rep("b", 5, "a"), rep("c", 5, "a"), rep("d", 5, "a")), 0.0, {"a"}),
])
def test_inside_the_ring(plan, registered, given, now, excluded):
    assert exclusions(plan, tuple(registered), given, now).members == excluded


def test_one_early_report_waits_for_the_others_up_to_the_grace():
    # Only b has reported (a-b broken); c and a have not yet: wait, do not guess.
    early = reports(rep("b", 5, "a", at=10.0))
    assert exclusions(ABC, ("a", "b", "c"), early, now=10.5, grace=1.0) == Exclusion(recheck_at=11.0)
    # Grace over: decide with what there is. b reaches etcd and probes; a, silent, may
    # be cut off from everything: a goes, although it holds rank 0.
    assert exclusions(ABC, ("a", "b", "c"), early, now=11.0, grace=1.0).members == {"a"}
    # Every member of the ring reported: no need to wait.
    full = reports(rep("a", 5, "b", at=10.0), rep("b", 5, "a", at=10.0), rep("c", 5, at=10.0))
    assert exclusions(ABC, ("a", "b", "c"), full, now=10.0, grace=1.0).members == {"b"}


AB = ring(6, "a", "b")  # the round after c was excluded


@pytest.mark.parametrize("given, excluded", [
    # Still cut: its own report names the ring's members.
    (reports(rep("a", 5, "c"), rep("b", 5, "c"), rep("c", 6, "a", "b")), {"c"}),
    # It reaches them again, but a member of the ring has not yet seen it back.
    (reports(rep("a", 6, "c"), rep("b", 6), rep("c", 6)), {"c"}),
    # Healed: every report between them clean: admitted.
    (reports(rep("a", 6), rep("b", 6), rep("c", 6)), set()),
    # A joiner that never reported anything is admitted as always.
    (reports(), set()),
    # A one-way fault: c says it reaches a and b, but a cannot reach c: stays out.
    (reports(rep("a", 6, "c"), rep("c", 6)), {"c"}),
])
def test_outside_the_ring_stays_out_until_every_report_between_them_is_clean(given, excluded):
    assert exclusions(AB, ("a", "b", "c"), given, now=0.0).members == excluded


def test_a_silent_member_goes_before_the_one_that_reported_it():
    """Seen in the chaos soak: d, the newest member (highest rank), was first to stall
    and reported c, whose link was cut (c can report nothing). Others silent, grace
    over: c must go. Dropping d, the later rank, would leave a ring with c in it that
    cannot form until c's lease runs out, and a healthy host out for a round."""
    abcd = ring(5, "a", "b", "c", "d")
    early = reports(rep("d", 5, "c", at=10.0))
    assert exclusions(abcd, tuple("abcd"), early, now=10.5, grace=1.0) == Exclusion(recheck_at=11.0)
    assert exclusions(abcd, tuple("abcd"), early, now=11.0, grace=1.0).members == {"c"}
    # When both sides reported, nothing tells them apart but the rank: the later goes.
    both = reports(rep("d", 5, "c", at=10.0), rep("c", 5, "d", at=10.2))
    assert exclusions(abcd, tuple("abcd"), both, now=11.2, grace=1.0).members == {"d"}


def test_no_plan_yet_excludes_nobody():
    assert exclusions(None, ("a", "b"), reports(rep("a", 0, "b")), now=0.0) == Exclusion()


def test_a_report_round_trips_through_json():
    report = rep("a", 7, "b", "c")
    assert ReachReport.from_json("a", report.to_json(), 3.0) == rep("a", 7, "b", "c", at=3.0)


def test_a_clean_report_of_an_earlier_stall_in_the_round_does_not_count_as_an_answer():
    stale = reports(rep("a", 5, at=1.0), rep("b", 5, "a", at=10.0), rep("c", 5, at=1.0))
    assert exclusions(ABC, ("a", "b", "c"), stale, now=10.2, grace=1.0) == Exclusion(recheck_at=11.0)


def test_a_silent_member_whose_every_pair_is_broken_is_not_waited_for():
    """A host whose link was cut reports nothing: once every other member has named it,
    its report could add no broken pair and tip no tie, so the grace is not waited."""
    abcd = ring(5, "a", "b", "c", "d")
    cut_c = reports(rep("a", 5, "c", at=10.0), rep("b", 5, "c", at=10.1), rep("d", 5, "c", at=10.2))
    assert exclusions(abcd, tuple("abcd"), cut_c, now=10.2, grace=1.0).members == {"c"}
    # Rank 0's host cut: the same, although ties would keep rank 0.
    cut_a = reports(rep("b", 5, "a", at=10.0), rep("c", 5, "a", at=10.1), rep("d", 5, "a", at=10.2))
    assert exclusions(abcd, tuple("abcd"), cut_a, now=10.2, grace=1.0).members == {"a"}
    # One survivor still to report: a pair of c (c-d) is not known broken: wait.
    early = reports(rep("a", 5, "c", at=10.0), rep("b", 5, "c", at=10.1))
    assert exclusions(abcd, tuple("abcd"), early, now=10.2, grace=1.0) == Exclusion(recheck_at=11.0)


def test_a_silent_member_that_could_tip_a_tie_is_waited_for():
    # Two members: b names a. a's report could only name b, which changes no pair, but a
    # silent a loses the tie and a reporting a wins it (b, the later rank, goes): wait.
    ab = ring(5, "a", "b")
    assert exclusions(ab, ("a", "b"), reports(rep("b", 5, "a", at=10.0)), now=10.5, grace=1.0) \
        == Exclusion(recheck_at=11.0)
    # Two silent members named by the other two: whether c and d reach each other is not
    # known (c-d is no broken pair yet), and their side may be the one that holds: wait.
    abcd = ring(5, "a", "b", "c", "d")
    given = reports(rep("a", 5, "c", "d", at=10.0), rep("b", 5, "c", "d", at=10.0))
    assert exclusions(abcd, tuple("abcd"), given, now=10.1, grace=1.0) == Exclusion(recheck_at=11.0)


@pytest.mark.parametrize("plan, member, given, expected", [
    # a (the coordinator's host) died hard: b and c name it, a reported nothing.
    (ABC, "a", reports(rep("b", 5, "a"), rep("c", 5, "a")), True),
    # One of them has not reported yet: not yet.
    (ABC, "a", reports(rep("b", 5, "a")), False),
    # c reported, but reaches a: no evidence.
    (ABC, "a", reports(rep("b", 5, "a"), rep("c", 5)), False),
    # a reported in this round: alive and reaching etcd, it decides for itself.
    (ABC, "a", reports(rep("b", 5, "a"), rep("c", 5, "a"), rep("a", 5, "b", "c")), False),
    # ... an old report of a's is no sign of life in this round.
    (ABC, "a", reports(rep("b", 5, "a"), rep("c", 5, "a"), rep("a", 4)), True),
    # Reports of an earlier round are about a ring that is gone.
    (ABC, "a", reports(rep("b", 4, "a"), rep("c", 4, "a")), False),
    # A ring of two: one report against the coordinator's own decision: never.
    (ring(5, "a", "b"), "a", reports(rep("b", 5, "a")), False),
    # Not in the ring (a coordinator without workers), or no plan: no evidence.
    (ABC, "z", reports(rep("a", 5, "z"), rep("b", 5, "z"), rep("c", 5, "z")), False),
    (None, "a", reports(rep("b", 5, "a"), rep("c", 5, "a")), False),
])
def test_cut_off_from_its_ring(plan, member, given, expected):
    assert cut_off_from_its_ring(plan, member, given) is expected
