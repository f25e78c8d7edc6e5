"""The device-watch thread's two later duties, on the CPU with fakes:

* G3' (gpu review gpu-3): NCCL runs with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, so a timed-out
  collective is only marked (TIMEOUT) and its kernel spins on; the watch thread aborts a ring
  that reports an error, so the round re-forms as gloo's collective timeout makes it;
* N7: the thread makes the worker's device its current one (and relaxed capture mode its
  own) before any CUDA call, else its event queries would make a context on GPU 0."""

from __future__ import annotations

import threading
import types

import pytest

from elastic.checkpoint import host_pinning
from elastic.worker import device_watch
from elastic.worker.device_watch import RELAXED_CAPTURE_MODE, DeviceWatch
from elastic.worker.ring_abort import RingHandle


class _Kind:
    def __init__(self, name):
        self.name = name


class _NcclBackend:
    """NCCL's backend as the ring sees it: ``get_error`` and ``abort``."""

    def __init__(self, error="SUCCESS"):
        self.error, self.aborts = error, 0

    def get_error(self):
        return _Kind(self.error)

    def abort(self):
        self.aborts += 1


_BOARD = types.SimpleNamespace(device_pending=lambda since: None)


def _watch(**kw):
    return DeviceWatch(_BOARD, lambda: pytest.fail("no event without a commit or a probe stream"), start=False, **kw)


@pytest.fixture(autouse=True)
def _no_ring_left_watched():
    yield
    device_watch.watch_ring(None)


@pytest.mark.parametrize("error, aborted", [
    ("SUCCESS", False),
    ("TIMEOUT", True),  # a collective past --collective-timeout: the victim's wait ends now
    ("COMM_ERROR", True),
    ("REMOTE_ERROR", True),
])
def test_a_poll_aborts_the_watched_ring_when_nccl_reports_an_error(error, aborted):
    backend = _NcclBackend(error)
    ring = RingHandle(frozenset(), other_backend=backend)
    device_watch.watch_ring(ring)  # what ring_entry does with each new ring
    watch = _watch()
    watch.poll()  # the thread's loop, once
    assert ring.aborted is aborted
    assert ring.wait_aborted() and backend.aborts == int(aborted)
    assert watch.aborted_for == (error if aborted else None)
    watch.poll()
    assert backend.aborts == int(aborted)  # once per ring


def test_a_gloo_ring_an_aborted_one_or_none_is_left_alone():
    watch = _watch(ring_source=lambda: None)
    assert watch.abort_on_ring_error() is None
    gloo = RingHandle(frozenset())  # no backend error state to read
    assert _watch(ring_source=lambda: gloo).abort_on_ring_error() is None and not gloo.aborted
    aborted = types.SimpleNamespace(aborted=True, error=lambda: pytest.fail("an aborted ring is not asked"))
    assert _watch(ring_source=lambda: aborted).abort_on_ring_error() is None


def test_a_forgotten_ring_is_not_watched():
    ring = RingHandle(frozenset(), other_backend=_NcclBackend("TIMEOUT"))
    device_watch.watch_ring(ring)
    del ring  # its round is gone: a weak reference
    assert device_watch.watched_ring() is None


def test_the_thread_sets_the_workers_device_before_any_cuda_call():
    calls, polled = [], threading.Event()

    class Event:
        def record(self, stream=None):
            calls.append("record")
            polled.set()

        def query(self):
            return True

    watch = DeviceWatch(_BOARD, Event, poll_s=0.01, probe_stream="default", device=3,
                        prepare_thread=lambda device: calls.append(("prepare", device)),
                        ring_source=lambda: None)
    try:
        assert polled.wait(10)
    finally:
        watch.close()
    assert calls[0] == ("prepare", 3) and "record" in calls[1:]


def test_preparing_the_thread_sets_the_device_and_relaxed_capture_mode(monkeypatch):
    import torch

    devices, modes = [], []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)

    class Runtime:
        def cudaThreadExchangeStreamCaptureMode(self, mode):
            modes.append(mode._obj.value)  # ctypes.byref(c_int)
            return 0

    monkeypatch.setattr(host_pinning, "loaded_cudart", lambda: Runtime())
    device_watch._prepare_cuda_thread(5)
    assert devices == [5] and modes == [RELAXED_CAPTURE_MODE]
    monkeypatch.setattr(host_pinning, "loaded_cudart", lambda: None)  # a static runtime: the device still
    device_watch._prepare_cuda_thread(2)
    assert devices == [5, 2]


def test_a_thread_that_cannot_be_prepared_still_watches(caplog):
    polled = threading.Event()

    def fail(device):
        raise RuntimeError("no CUDA")

    watch = DeviceWatch(_BOARD, poll_s=0.01, prepare_thread=fail, ring_source=lambda: polled.set())
    try:
        assert polled.wait(10)
    finally:
        watch.close()
    assert "could not prepare its thread" in caplog.text
