"""No commit on a broken ring: a commit that finds its ring aborted or in error raises a
ring failure and leaves the previous commit as it was (a real ``Ring`` and its gate; only
its control channel and round store are stand-ins)."""

from __future__ import annotations

import types

import pytest
import torch

from elastic.state import State
from elastic.worker import ring_abort
from elastic.contract.faults import RING
from elastic.worker.failures import classify
from elastic.worker.ring_abort import RingBroken, RingHandle
from tests.fakes.ring import installed, real_ring


class _FakeNccl:
    """A backend with NCCL's error state (``get_error()`` -> an ErrorType-like value)."""

    def __init__(self):
        self.kind = types.SimpleNamespace(name="SUCCESS")
        self.aborts = 0

    def get_error(self):
        return self.kind

    def abort(self):
        self.aborts += 1


def _committed():
    state = State(weights=torch.arange(4.0), epoch=1)
    state.commit()
    state.weights.add_(100.0)  # the step that follows: partial gradients on a broken ring
    state.epoch = 2
    return state


def test_commit_after_an_abort_raises_and_keeps_the_previous_commit():
    handle = RingHandle(frozenset())  # a gloo ring without connections
    with installed(real_ring(handle)):
        state = _committed()
        before = state.commit_id
        handle.abort()
        with pytest.raises(RingBroken, match="aborted") as raised:
            state.commit()
    assert classify(raised.value).kind == RING  # recovery re-forms; no user error
    assert state.commit_id == before
    state.restore()
    assert torch.equal(state.weights, torch.arange(4.0)) and state.epoch == 1


def test_commit_on_a_backend_that_reports_an_error_raises():
    backend = _FakeNccl()
    with installed(real_ring(RingHandle(frozenset(), other_backend=backend))):
        state = _committed()
        before = state.commit_id
        backend.kind = types.SimpleNamespace(name="REMOTE_ERROR")
        with pytest.raises(RingBroken, match="REMOTE_ERROR"):
            state.commit()
    assert state.commit_id == before
    state.restore()
    assert torch.equal(state.weights, torch.arange(4.0))


def test_a_healthy_ring_commits():
    backend = _FakeNccl()
    with installed(real_ring(RingHandle(frozenset(), other_backend=backend))):
        state = _committed()
        state.commit()
    assert state.commit_id.count == 2 and backend.aborts == 0


@pytest.mark.parametrize("backend, synced", [("nccl", True), ("cpu:gloo,cuda:nccl", True), ("gloo", False)])
def test_only_nccl_rings_wait_for_the_device_before_the_check(monkeypatch, backend, synced):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(synchronize=lambda: calls.append(1)))
    ring_abort.check_ring(None, device_sync=ring_abort.uses_nccl(backend))
    assert bool(calls) == synced
