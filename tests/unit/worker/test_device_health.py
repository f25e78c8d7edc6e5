"""The bounded device sync before a rejoin, with fake sync functions (no GPU needed)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elastic.contract.errors import BrokenProcess
from elastic.worker.device_health import bounded, check_device
from elastic.contract.faults import PROCESS
from elastic.worker.failures import classify
from tests.fakes.ring import FakeRing, real_ring


def test_a_sync_that_returns_in_time_passes():
    assert bounded(lambda: time.sleep(0.01), 5.0) is True


def test_a_sync_that_never_returns_is_given_up_on_at_the_bound():
    release = threading.Event()
    started = time.monotonic()
    try:
        assert bounded(lambda: release.wait(30), 0.2) is False
        assert time.monotonic() - started < 5.0  # the bound, plus a loaded machine's slack
    finally:
        release.set()


def test_the_syncs_own_error_reaches_the_caller():
    def sticky():
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(torch.AcceleratorError) as caught:
        bounded(sticky, 5.0)
    assert classify(caught.value).kind == PROCESS


def test_check_device_on_a_hung_device_is_a_broken_process(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    release = threading.Event()
    try:
        with pytest.raises(BrokenProcess, match="cuda:1 did not finish its queued work within 0.2s") as caught:
            check_device("nccl", 0.2, synchronize=lambda device: release.wait(30), cuda_available=lambda: True)
        assert classify(caught.value).kind == PROCESS
    finally:
        release.set()


@pytest.mark.parametrize("backend, cuda, expected_calls", [
    ("gloo", True, 0),  # no CUDA in the ring: nothing to check
    ("nccl", False, 0),
    ("cpu:gloo,cuda:nccl", True, 1),
    ("nccl", True, 1),
])
def test_check_device_runs_only_on_cuda(backend, cuda, expected_calls):
    calls = []
    took = check_device(backend, 5.0, slot=0, synchronize=lambda device: calls.append(1), cuda_available=lambda: cuda)
    assert len(calls) == expected_calls
    assert (took is None) == (expected_calls == 0)


def _cuda_like_current_device(main_thread_device: int):
    """As CUDA keeps it: the current device is per host thread, and a new thread starts on 0."""
    return lambda: main_thread_device if threading.current_thread() is threading.main_thread() else 0


@pytest.mark.parametrize("slot, expected", [(3, 3), (None, 5)])
def test_the_check_syncs_this_workers_own_device_from_its_thread(monkeypatch, slot, expected):
    # torch.cuda.synchronize() with no device, in a fresh thread, syncs cuda:0.
    monkeypatch.setattr(torch.cuda, "current_device", _cuda_like_current_device(5))
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(
        (device, threading.current_thread() is threading.main_thread())))
    check_device("cpu:gloo,cuda:nccl", 5, slot=slot, cuda_available=lambda: True)
    assert synced == [(torch.device("cuda", expected), False)]


class _Ring:
    def __init__(self, calls, backend_abort=True):
        self.calls, self.backend_abort = calls, backend_abort

    def abort(self):
        self.calls.append("abort")

    def wait_aborted(self):
        self.calls.append("wait_aborted")
        return True


@pytest.mark.parametrize("backend_abort, expected", [(True, ["abort", "wait_aborted"]), (False, [])])
def test_the_ring_aborts_only_its_nccl_part_before_the_check(backend_abort, expected):
    calls = []
    ring = real_ring(_Ring(calls, backend_abort))
    ring.abort_device()
    assert calls == expected  # left later, by Ring.leave


def test_recovery_aborts_the_old_ring_before_checking_the_device_then_restores(monkeypatch):
    from elastic.worker import recovery

    calls = []

    class FakeState:
        def restore(self):
            calls.append("restore")

    ring = FakeRing(backend="cpu:gloo,cuda:nccl")
    ring.local_rank, ring.calls = 3, calls
    monkeypatch.setattr(recovery, "check_device", lambda backend, timeout_s, slot: calls.append(("check", slot)))
    recovery._check_and_restore(ring, FakeState(), 60.0)
    assert calls == ["abort_device", ("check", 3), "restore"]
