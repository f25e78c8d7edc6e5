"""Which newer plans make the control thread abort the current ring (``RingCell.on_control``,
deciding with ``abort_reason``), as a table: a loss of one of its workers, and any round
formed to recover from a failure (a reset request names no one lost, and on NCCL nothing
else wakes the other workers' kernels)."""

from __future__ import annotations

import pytest

from elastic.worker.ring_abort import peer_lost
from elastic.worker.ring_entry import Forming, RingCell
from elastic.rendezvous import JobStatus, RoundPlan
from elastic.rendezvous.rounds import Slot

WORKERS = ("m.w0", "m.w1")


def plan(round_, workers=WORKERS, lost=(), recovers=False):
    return RoundPlan(round_, tuple(Slot("m", w) for w in workers), {"m": ("h", "127.0.0.1")}, "127.0.0.1:1", 0.0,
                     lost=tuple(lost), recovers=recovers)


class FakeRing:
    def __init__(self):
        self.aborts = 0

    def abort(self):
        self.aborts += 1


@pytest.mark.parametrize("newer, status, aborts", [
    (plan(3, lost=("m.w1",), recovers=True), JobStatus(), 1),  # a worker of ours lost
    (plan(3, recovers=True), JobStatus(), 1),  # G4: a reset request, no one lost
    (plan(3, WORKERS + ("m.w2",)), JobStatus(), 0),  # a planned switch (a joiner): switch at a commit
    (plan(3, lost=("other.w9",)), JobStatus(), 0),  # a loss outside our ring, not a recovery
    (plan(2, recovers=True), JobStatus(), 0),  # our own round again
    (plan(1, recovers=True), JobStatus(), 0),  # an older one
    (plan(2), JobStatus(state="failed", reason="user error"), 1),  # the job failed
])
def test_which_plans_abort_the_ring(newer, status, aborts):
    cell, handle = RingCell(), FakeRing()
    cell.hold_forming(Forming(plan(2), handle), None, JobStatus())  # nothing announced yet
    cell.on_control(newer, status)  # the control thread's delivery
    assert handle.aborts == aborts
    # Held while the plan was known already: the same decision, at once.
    held_late = FakeRing()
    RingCell().hold_forming(Forming(plan(2), held_late), newer, status)
    assert held_late.aborts == aborts


@pytest.mark.parametrize("newer, lost", [
    (plan(3, lost=("m.w1",), recovers=True), True),  # a worker of the forming ring is gone
    (plan(3, recovers=True), False),  # a reset round (the first failed init asks for it): no evidence of a death
    (plan(3, lost=("other.w9",), recovers=True), False),  # a loss outside this ring
    (plan(2, lost=("m.w1",)), False),  # not newer
    (None, False),
])
def test_only_a_named_loss_makes_a_failed_init_a_ring_failure_rather_than_the_network(newer, lost):
    # Since reset rounds abort the ring, ring_breaks is true for them; a failed init
    # of the same round must still read as the network (tests/hosts/test_addressing_hosts.py).
    assert peer_lost(newer, plan(2)) is lost
