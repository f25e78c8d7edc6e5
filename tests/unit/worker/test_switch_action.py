"""Stop or switch at a commit: every worker does what rank 0 decided.

At a switch point rank 0 decides from its view of the job (a stop, or a pending round
whose joiners arrived) and every rank takes its word in one broadcast over the ring; the
other ranks act on that word, never on their own copy of the status, which may lag or
lead rank 0's, and never on anything in the round's store, which more than the ring can
reach. Here with a fake control channel and a wire that plays the broadcast.
"""

from __future__ import annotations

import time

import pytest

from elastic.contract.errors import PeerDataInvalid
from elastic.rendezvous import STOPPING, JobStatus, RoundPlan
from elastic.rendezvous.rounds import Slot
from elastic.worker.commit_gate import CommitGate, Monitors, SwitchAt, Verdict, decide_switch
from elastic.worker.failures import RING, classify


class Control:
    def __init__(self, plan, status=JobStatus()):
        self.plan, self.status = plan, status


def plan(round_number, workers):
    return RoundPlan(round=round_number, slots=tuple(Slot("m", w) for w in workers),
                     hosts={"m": ("h", "127.0.0.1")}, store_addr="127.0.0.1:1", created=time.time())


class Wire:
    """The switch point's broadcast between two gates: rank 0's words as posted at each
    point, taken at the next."""

    def __init__(self):
        self.sent: dict[int, list] = {}  # point number -> rank 0's words

    def exchange(self, rank, gate):
        def exchange(words):
            point = gate.commits
            if rank == 0:
                self.sent[point] = words
            return lambda: self.sent[point]
        return exchange


class Ring:
    """One rank's gate in the ring ``current`` (a ring's gate is built with it: ``ring.py``)."""

    def __init__(self, rank, wire, control, current):
        self.control = control
        self.gate = CommitGate(Monitors(steps=None, control=control), current, rank,
                               exchange=lambda words: self._exchange(words))
        self._exchange = wire.exchange(rank, self.gate)

    def acts(self, commits) -> Verdict:
        self.gate.commits = commits
        return self.gate.verdict()


CURRENT = plan(3, ["m.w0", "m.w1"])


def first_acting(rank0, other, limit=20):
    """Commit both ranks, rank 0 first at each commit, until the gates act: (commit, rank 0's
    action, the other's action)."""
    for commits in range(1, limit + 1):
        mine, theirs = rank0.acts(commits), other.acts(commits)
        if mine is not Verdict.CONTINUE or theirs is not Verdict.CONTINUE:
            return commits, mine.value, theirs.value
    return None


@pytest.mark.parametrize("rank0_sees_stop, other_sees_stop", [(True, False), (False, True)])
def test_the_other_ranks_do_what_rank_0_decided_not_what_their_own_status_says(rank0_sees_stop, other_sees_stop):
    wire = Wire()
    # A pending round with no joiners (a graceful leave): rank 0 switches to it, unless it sees a stop.
    pending = plan(4, ["m.w0"])
    rank0 = Ring(0, wire, Control(pending, JobStatus(STOPPING if rank0_sees_stop else "running")), CURRENT)
    other = Ring(1, wire, Control(pending, JobStatus(STOPPING if other_sees_stop else "running")), CURRENT)
    expected = "stop" if rank0_sees_stop else "switch"
    # Every commit of a fresh round is a point: decided at the first, acted on at the second.
    assert first_acting(rank0, other) == (2, expected, expected)


def test_nothing_happens_while_rank_0_sees_neither_a_stop_nor_a_round():
    wire = Wire()
    rank0 = Ring(0, wire, Control(CURRENT), CURRENT)
    other = Ring(1, wire, Control(CURRENT, JobStatus(STOPPING)), CURRENT)  # ahead of rank 0's view
    assert first_acting(rank0, other, limit=5) is None, "a rank stopped on its own status"
    assert set(wire.sent) == {1, 2, 3, 4, 5} and all(words == [-1, 0] for words in wire.sent.values())


def test_between_points_nobody_decides_and_nothing_is_exchanged():
    wire = Wire()
    pending = plan(4, ["m.w0"])
    rank0, other = Ring(0, wire, Control(CURRENT), CURRENT), Ring(1, wire, Control(pending), CURRENT)
    for ring in (rank0, other):
        ring.gate.points.agree(0, 0.05)  # a point every 5 commits (0.25 s of 50 ms steps)
    assert first_acting(rank0, other, limit=3) is None
    rank0.control.plan = pending  # rank 0 sees the round at commit 4: decides at the point 5, acts at 10
    for commits in range(4, 10):
        assert (rank0.acts(commits), other.acts(commits)) == (Verdict.CONTINUE, Verdict.CONTINUE), commits
    assert (rank0.acts(10), other.acts(10)) == (Verdict.SWITCH, Verdict.SWITCH)
    assert sorted(wire.sent) == [5]  # nothing posted at the point the ring acts


def test_an_impossible_word_from_rank_0_is_a_ring_failure_not_a_stop():
    # Rank 0 is a member of the ring: a word it could not have sent is a ring fault (the
    # ring re-forms), never the user's error and never a stop.
    other = CommitGate(Monitors(steps=None, control=Control(CURRENT)), CURRENT, 1,
                       exchange=lambda words: lambda: [9, 2])  # a stop decided at a later point
    other.commits = 3
    assert other.verdict() is Verdict.CONTINUE  # posted at 3
    other.commits = 4
    with pytest.raises(PeerDataInvalid) as raised:
        other.verdict()
    assert classify(raised.value).kind == RING
    assert other.switch is None


# -- rank 0's choice, a pure function ---------------------------------------------------

@pytest.mark.parametrize("stopping, pending, ready, commits, expected", [
    (False, False, True, 5, None),  # nothing to do
    (False, True, False, 5, None),  # a round pending, its joiners not yet arrived
    (False, True, True, 5, SwitchAt(5, Verdict.SWITCH)),  # at this point: the ring hears it at the next
    (True, False, False, 5, SwitchAt(5, Verdict.STOP)),
    (True, True, True, 8, SwitchAt(8, Verdict.STOP)),  # a stop wins over a pending round
])
def test_rank_0_decides_for_the_point_it_is_at(stopping, pending, ready, commits, expected):
    asked = []
    ready_fn = lambda: asked.append(1) or ready  # noqa: E731
    choice = decide_switch(stopping=stopping, pending=pending, joiners_ready=ready_fn, commits=commits)
    assert choice == expected
    assert bool(asked) == (pending and not stopping), "the joiners' store is read only for a pending round"
