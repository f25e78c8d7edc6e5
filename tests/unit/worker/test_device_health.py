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
            check_device("nccl", 0.2, synchronize=lambda: release.wait(30), cuda_available=lambda: True)
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
    took = check_device(backend, 5.0, synchronize=lambda: calls.append(1), cuda_available=lambda: cuda)
    assert len(calls) == expected_calls
    assert (took is None) == (expected_calls == 0)
