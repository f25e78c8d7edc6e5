"""Between an NCCL abort and the next collective, user code runs on
weights the queued optimizer step corrupted; an exception it raises there (a NaN guard,
an assert) re-forms the ring instead of failing the job as the user's bug."""

from __future__ import annotations

import pytest
import torch

from elastic.contract.faults import PROCESS, RING, USER
from elastic.worker.outcome import Broken, outcome_of
from elastic.worker.failures import classify_in_window
from elastic.worker.ring_abort import RingHandle, broken_reason
from tests.fakes.ring import FakeRing


@pytest.mark.parametrize("exc, broken, kind", [
    (ValueError("loss is not finite"), "aborted", RING),
    (AssertionError("loss.item() < 1e4"), "TIMEOUT", RING),
    (ValueError("loss is not finite"), None, USER),  # no broken ring: the user's bug, as before
    (torch.AcceleratorError("CUDA error: uncorrectable ECC error encountered"), "aborted", PROCESS),
    (torch.AcceleratorError("CUDA error: device-side assert triggered"), None, USER),
])
def test_an_error_in_the_window_after_an_abort(exc, broken, kind):
    fault = classify_in_window(exc, broken)
    assert fault.kind == kind
    if kind == RING:
        assert broken in fault.reason and type(exc).__name__ in fault.reason


class _Backend:
    def __init__(self, error="SUCCESS"):
        self.error = error

    def get_error(self):
        return type("Kind", (), {"name": self.error})()

    def abort(self):
        pass


def test_broken_reason_of_a_ring():
    assert broken_reason(None) is None
    healthy = RingHandle(frozenset(), other_backend=_Backend())
    assert broken_reason(healthy) is None
    assert broken_reason(RingHandle(frozenset(), other_backend=_Backend("TIMEOUT"))) == "TIMEOUT"
    healthy.abort()
    assert broken_reason(healthy) == "aborted"


@pytest.mark.parametrize("broken, interrupted", [("aborted", True), (None, False)])
def test_the_training_functions_error_after_an_abort_is_a_ring_interruption(broken, interrupted):
    ring = FakeRing(broken=broken)

    def body():
        raise ValueError("loss is not finite")

    if not interrupted:
        with pytest.raises(ValueError):
            outcome_of(ring.broken_reason, body)
        return
    outcome = outcome_of(ring.broken_reason, body)
    assert isinstance(outcome, Broken) and outcome.failed and "after the ring broke" in outcome.reason
