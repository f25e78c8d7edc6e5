"""Stop or switch at a commit: every worker does what rank 0 published (issue 12, item 4).

Rank 0 decides from its view of the job (a stop, or a pending round whose joiners
arrived) and publishes ``switch_at`` with the action in the round's store; the other
ranks act on that record, never on their own copy of the status, which may lag or
lead rank 0's. Here against an in-memory store and a fake control channel.
"""

from __future__ import annotations

import time

import pytest

from elastic.worker.runtime import Runtime
from elastic.rendezvous import STOPPING, JobStatus, RoundPlan
from elastic.rendezvous.rounds import Slot


class DictStore:
    """The calls ``should_switch`` makes on the round's PrefixStore."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


class Control:
    def __init__(self, plan, status=JobStatus()):
        self.plan, self.status = plan, status


def plan(round_number, workers):
    return RoundPlan(round=round_number, slots=tuple(Slot("m", w) for w in workers),
                     hosts={"m": ("h", "127.0.0.1")}, store_addr="127.0.0.1:1", created=time.time())


def runtime(rank, store, control, current):
    rt = Runtime(None)
    rt.rank, rt.round, rt.plan = rank, current.round, current
    rt._store, rt._control = store, control
    return rt


CURRENT = plan(3, ["m.w0", "m.w1"])


def commit_until_acting(rt, limit=20):
    """Commit until ``should_switch`` says the ring acts; (commit number, action)."""
    for commits in range(1, limit + 1):
        if rt.should_switch(commits):
            return commits, rt._switch_action
    return None, None


@pytest.mark.parametrize("rank0_sees_stop, other_sees_stop", [(True, False), (False, True)])
def test_the_other_ranks_do_what_rank_0_published_not_what_their_own_status_says(rank0_sees_stop, other_sees_stop):
    store = DictStore()
    # A pending round with no joiners (a graceful leave): rank 0 switches to it, unless it sees a stop.
    pending = plan(4, ["m.w0"])
    rank0 = runtime(0, store, Control(pending, JobStatus(STOPPING if rank0_sees_stop else "running")), CURRENT)
    other = runtime(1, store, Control(pending, JobStatus(STOPPING if other_sees_stop else "running")), CURRENT)

    at, action = commit_until_acting(rank0)
    expected = "stop" if rank0_sees_stop else "switch"
    # Published at the first commit, for the next one: every rank reads it in between.
    assert (at, action) == (2, expected)
    assert store.data["switch_at"] == f"2 {expected}".encode()
    # The other rank, whatever its own status says, acts at the same commit the same way.
    assert commit_until_acting(other) == (2, expected)


def test_nothing_is_published_while_rank_0_sees_neither_a_stop_nor_a_round():
    store = DictStore()
    rank0 = runtime(0, store, Control(CURRENT), CURRENT)
    other = runtime(1, store, Control(CURRENT, JobStatus(STOPPING)), CURRENT)  # ahead of rank 0's view
    assert commit_until_acting(rank0, limit=5) == (None, None)
    assert commit_until_acting(other, limit=5) == (None, None), "a rank stopped on its own status"
    assert "switch_at" not in store.data
