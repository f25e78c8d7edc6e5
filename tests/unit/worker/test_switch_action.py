"""Stop or switch at a commit: every worker does what rank 0 published (issue 12, item 4).

Rank 0 decides from its view of the job (a stop, or a pending round whose joiners
arrived) and publishes ``switch_at`` with the action in the round's store; the other
ranks act on that record, never on their own copy of the status, which may lag or
lead rank 0's. Here against an in-memory store and a fake control channel.
"""

from __future__ import annotations

import threading
import time

import pytest

from elastic.contract.errors import PeerDataInvalid
from elastic.worker import switch_points
from elastic.worker.failures import RING, classify
from elastic.worker.commit_gate import CommitGate, Monitors, SwitchAt, Verdict, decide_switch
from elastic.worker.switch_points import SwitchPoints
from elastic.rendezvous import STOPPING, JobStatus, RoundPlan
from elastic.rendezvous.rounds import Slot
from tests.fakes.ring import DictStore


class Control:
    def __init__(self, plan, status=JobStatus()):
        self.plan, self.status = plan, status


def plan(round_number, workers):
    return RoundPlan(round=round_number, slots=tuple(Slot("m", w) for w in workers),
                     hosts={"m": ("h", "127.0.0.1")}, store_addr="127.0.0.1:1", created=time.time())


class Ring:
    """One rank's gate in the ring ``current`` (a ring's gate is built with it: ``ring.py``)."""

    def __init__(self, rank, store, control, current):
        self.gate = CommitGate(Monitors(steps=None, control=control), store, current, rank)
        self.control = control

    def acts(self, commits) -> Verdict:
        self.gate.commits = commits
        return self.gate.verdict()


def gate_of(rank, store, control, current):
    return Ring(rank, store, control, current)


CURRENT = plan(3, ["m.w0", "m.w1"])


def commit_until_acting(rt, limit=20):
    """Commit until the gate's verdict says the ring acts; (commit number, action)."""
    for commits in range(1, limit + 1):
        verdict = rt.acts(commits)
        if verdict is not Verdict.CONTINUE:
            return commits, verdict.value
    return None, None


@pytest.mark.parametrize("rank0_sees_stop, other_sees_stop", [(True, False), (False, True)])
def test_the_other_ranks_do_what_rank_0_published_not_what_their_own_status_says(rank0_sees_stop, other_sees_stop):
    store = DictStore()
    # A pending round with no joiners (a graceful leave): rank 0 switches to it, unless it sees a stop.
    pending = plan(4, ["m.w0"])
    rank0 = gate_of(0, store, Control(pending, JobStatus(STOPPING if rank0_sees_stop else "running")), CURRENT)
    other = gate_of(1, store, Control(pending, JobStatus(STOPPING if other_sees_stop else "running")), CURRENT)

    at, action = commit_until_acting(rank0)
    expected = "stop" if rank0_sees_stop else "switch"
    # Published at the first commit, for the next one: every rank reads it in between.
    assert (at, action) == (2, expected)
    assert store.data["switch_at"] == f"2 {expected}".encode()
    # The other rank's status lags (its watch delivers the stop a moment later): it waits
    # for its own view of etcd to show the reason, then acts as rank 0 published.
    if rank0_sees_stop:
        threading.Timer(0.2, lambda: setattr(other.control, "status", JobStatus(STOPPING))).start()
    assert commit_until_acting(other) == (2, expected)


def test_nothing_is_published_while_rank_0_sees_neither_a_stop_nor_a_round():
    store = DictStore()
    rank0 = gate_of(0, store, Control(CURRENT), CURRENT)
    other = gate_of(1, store, Control(CURRENT, JobStatus(STOPPING)), CURRENT)  # ahead of rank 0's view
    assert commit_until_acting(rank0, limit=5) == (None, None)
    assert commit_until_acting(other, limit=5) == (None, None), "a rank stopped on its own status"
    assert "switch_at" not in store.data


# -- a value written into the round's store by a stranger (security review, finding 2) ----

@pytest.mark.parametrize("value", [b"0 stop", b"x", b"2 explode", b"2", b"\xff stop", b"-1 switch"])
def test_a_malformed_or_past_switch_at_is_a_ring_failure_not_a_stop(value):
    store = DictStore()
    store.set("switch_at", value)
    other = gate_of(1, store, Control(CURRENT), CURRENT)
    with pytest.raises(PeerDataInvalid) as raised:
        other.acts(1)  # every commit of a fresh round is a point: it reads the value
    assert classify(raised.value).kind == RING
    assert other.gate.switch is None


@pytest.mark.parametrize("action", ["stop", "switch"])
def test_a_well_formed_switch_at_that_etcd_gives_no_reason_for_is_a_ring_failure(action, monkeypatch):
    monkeypatch.setattr(switch_points, "CONFIRM_S", 0.2)
    store = DictStore()
    store.set("switch_at", f"3 {action}")  # a stranger's: rank 0 saw neither a stop nor a newer plan
    other = gate_of(1, store, Control(CURRENT), CURRENT)
    started = time.monotonic()
    with pytest.raises(PeerDataInvalid, match="etcd shows no reason"):
        commit_until_acting(other, limit=3)
    assert time.monotonic() - started < 5
    assert other.gate.switch is None


@pytest.mark.parametrize("value, commits, expected", [
    (b"5 stop", 5, (5, "stop")),
    (b"9 switch", 2, (9, "switch")),
])
def test_parse_switch_at(value, commits, expected):
    assert switch_points.parse_switch_at(value, commits) == expected


# -- rank 0's choice, a pure function ---------------------------------------------------

def _points(every=1, origin=0):
    points = SwitchPoints()
    points.every, points.origin = every, origin
    return points


@pytest.mark.parametrize("stopping, pending, ready, commits, every, expected", [
    (False, False, True, 5, 1, None),  # nothing to do
    (False, True, False, 5, 1, None),  # a round pending, its joiners not yet arrived
    (False, True, True, 5, 1, SwitchAt(6, Verdict.SWITCH)),  # at the next point
    (True, False, False, 5, 1, SwitchAt(6, Verdict.STOP)),
    (True, True, True, 5, 1, SwitchAt(6, Verdict.STOP)),  # a stop wins over a pending round
    (False, True, True, 5, 4, SwitchAt(8, Verdict.SWITCH)),  # points every 4 commits
    (True, False, False, 8, 4, SwitchAt(12, Verdict.STOP)),  # at a point: the next one
])
def test_rank_0_decides_at_the_next_switch_point(stopping, pending, ready, commits, every, expected):
    asked = []
    ready_fn = lambda: asked.append(1) or ready  # noqa: E731
    choice = decide_switch(stopping=stopping, pending=pending, joiners_ready=ready_fn, commits=commits,
                           points=_points(every))
    assert choice == expected
    assert bool(asked) == (pending and not stopping), "the joiners' store is read only for a pending round"
