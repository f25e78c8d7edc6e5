"""The three kinds of ring a state may be handed (a job's ``Ring``, the world of one's
``LocalRing``, a test's ``FakeRing``) all answer ``RingView``; the world of one commits
without a check or a verdict of anyone else's, and its session has no etcd."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elastic.contract.events import EventLog
from elastic.state import State
from elastic.worker import lifecycle
from elastic.worker.commit_gate import Verdict
from elastic.worker.local_ring import LOCAL_CONFIG, LocalRing
from elastic.worker.ring_abort import RingHandle
from elastic.worker.ring_view import ALONE, RingView
from elastic.worker.session import WorkerSession
from elastic.worker.step_log import StepLog
from tests.fakes.ring import FakeRing, real_ring


def _local() -> LocalRing:
    events = EventLog(None, host="local")
    return LocalRing(events, StepLog(events, "local"))


@pytest.mark.parametrize("make", [_local, FakeRing, lambda: real_ring(RingHandle(frozenset()))],
                         ids=["LocalRing", "FakeRing", "Ring"])
def test_every_kind_of_ring_is_a_ring_view(make):
    ring = make()
    assert isinstance(ring, RingView)
    assert ring.config.worker_id and ring.capability.backend == ring.backend


def test_the_world_of_one_commits_alone_and_never_re_forms():
    ring = _local()
    seen = []
    assert ring.commit(lambda view: seen.append(view) or 7) is Verdict.CONTINUE
    assert seen == [ring] and ring.broken_reason() is None and ring.publish_check() is None
    assert (ring.rank, ring.world_size, ring.round, ring.plan) == (0, 1, 0, None)
    assert LOCAL_CONFIG.max_resets == 0 and LOCAL_CONFIG.checkpoint_dir is None


def test_a_session_alone_serves_its_local_ring_to_state_commit():
    assert lifecycle._current is None and not dist.is_initialized()
    lifecycle.install(WorkerSession.alone())  # elastic.init() without elastic-run
    try:
        session = lifecycle.current()
        assert isinstance(lifecycle.ring(), LocalRing) and session.position == ALONE and session.round == 0
        assert session.joining_round is None and dist.is_initialized()
        state = State(step=1)
        state.commit()
        assert state.commit_id.count == 1
    finally:
        lifecycle.shutdown()
    assert not dist.is_initialized()  # the group of one left with the session
