"""GPU progress for the hang watchdog: is the device's work completing?

A worker hung in a kernel is invisible to the heartbeat's look at the main thread:
CUDA's default synchronization spins, so a main thread in ``.item()`` or a stream
sync burns CPU (busy, never stuck), or sits in a runtime frame (a victim). So each
commit records a CUDA event on the current stream as it starts (before its device
sync: the step's work is behind it), and the watch thread records a probe event on
the device's default stream whenever the previous probe has completed (a hang in
the middle of a step, with the host blocked in ``.item()`` before any commit, stops
the probes). The thread polls both: the board's ``device_since`` slot says since
when device work has been pending (0.0: none), and the agent's watchdog calls a long
pending a hang (``elastic/agent/watchdog.py``, "device"). A busy device completes a
probe once the work queued before it is done: well within the watchdog's bounds.

Started only once the worker uses CUDA (``torch.cuda.is_initialized()`` at a
commit): a CPU worker never records an event nor starts the thread.

The same thread aborts an NCCL ring that reports an error (gpu-3 G3'). The workers run
NCCL with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: NCCL's watchdog only marks a timed-out
collective (``TIMEOUT``) and its kernel spins on, so a rank whose peer is slow by more
than ``--collective-timeout`` would wait in its commit's stream sync until the agent
kills it as a device hang. Gloo ends such a wait at the collective timeout and the ring
re-forms in-process; ``watch_ring`` makes NCCL's end the same way: each poll asks the
round's ring for its error and, on one, aborts it (``RingHandle.abort``: the pending
kernels exit, the commit raises ``RingBroken``, the recovery path re-forms).

Two more rules for the thread (gpu-3 N7): it makes the worker's device its current one
before any CUDA call (a new thread starts on device 0, where it would make a context of
its own), and it puts itself in CUDA's relaxed stream-capture mode, so that its event
queries never invalidate a user's ``torch.cuda.graph`` capture in the default global
mode (they are "unsafe" calls while another thread captures).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
import weakref
from typing import Callable, Optional

log = logging.getLogger(__name__)

POLL_S = 0.25  # like the heartbeat: the agent's bounds are seconds
MAX_PENDING = 64  # events kept; the oldest pending one is what counts


class DeviceWatch:
    """``on_commit()`` on the main thread; a daemon thread writes ``board.device_pending``."""

    def __init__(self, board, make_event: Optional[Callable[[], object]] = None, *,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = POLL_S, start: bool = True,
                 probe_stream=None, device: Optional[int] = None,
                 ring_source: Optional[Callable[[], object]] = None,
                 prepare_thread: Optional[Callable[[Optional[int]], None]] = None):
        self._board = board
        self._device = device  # the worker's CUDA device: the thread's current one (N7)
        self._ring_source = ring_source or watched_ring  # the round's ring, asked for its error (G3')
        self._prepare_thread = prepare_thread or _prepare_cuda_thread
        self.aborted_for: Optional[str] = None  # the error a ring was aborted for by this thread, last
        self._make_event = make_event or _cuda_event
        self._clock = clock
        self._poll_s = poll_s
        self._probe_stream = probe_stream  # where the thread's probes go (None: no probes)
        self._probe: Optional[tuple] = None  # (event, recorded at) of the probe in flight
        self._pending: collections.deque = collections.deque()  # (event, queued at), oldest first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-device-watch", daemon=True)
        if start:
            self._thread.start()

    def on_commit(self) -> None:
        """Mark the device work queued so far (one event on the current stream)."""
        if len(self._pending) >= MAX_PENDING:
            return  # the oldest pending event already says since when
        event = self._make_event()
        event.record()
        self._pending.append((event, self._clock()))

    def poll(self) -> float:
        """Drop the completed events, probe again if the last probe completed; write and
        return since when work is pending (0.0: none)."""
        while self._pending and _done(self._pending[0][0]):
            self._pending.popleft()
        if self._probe is not None and _done(self._probe[0]):
            self._probe = None
        if self._probe is None and self._probe_stream is not None:
            event = self._make_event()
            event.record(self._probe_stream)
            self._probe = (event, self._clock())
        times = [t for t in (self._pending[0][1] if self._pending else 0.0,
                             self._probe[1] if self._probe else 0.0) if t]
        since = min(times) if times else 0.0
        self._board.device_pending(since)
        self.abort_on_ring_error()
        return since

    def abort_on_ring_error(self) -> Optional[str]:
        """Abort the watched ring if its backend reports an error (NCCL's TIMEOUT,
        COMM_ERROR, REMOTE_ERROR); the error, or None."""
        ring = self._ring_source()
        if ring is None or ring.aborted:
            return None
        error = ring.error()
        if error is None:
            return None
        log.warning("device watch: the ring reports %s; aborting it so that the round re-forms (as gloo's "
                    "collective timeout does)", error)
        self.aborted_for = error
        ring.abort()
        return error

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        try:
            self._prepare_thread(self._device)
        except Exception as exc:  # noqa: BLE001 - the watch still works; say why it is not prepared
            log.warning("device watch: could not prepare its thread: %s: %s", type(exc).__name__, exc)
        while not self._stop.wait(self._poll_s):
            self.poll()


_watched: Optional["weakref.ref"] = None


def watch_ring(ring) -> None:
    """The round's ring, for every device watch of this process to abort on an error
    (G3'). Call it with each new ring (the runtime, right after ``prepare_ring``); a
    weak reference: a forgotten ring is gone with its round."""
    global _watched
    _watched = weakref.ref(ring) if ring is not None else None


def watched_ring():
    return _watched() if _watched is not None else None


RELAXED_CAPTURE_MODE = 2  # cudaStreamCaptureModeRelaxed


def _prepare_cuda_thread(device: Optional[int]) -> None:
    """The worker's device as this thread's current one, and relaxed capture mode for it."""
    import torch

    if device is not None:
        torch.cuda.set_device(device)
    from elastic.checkpoint.host_pinning import loaded_cudart

    library = loaded_cudart()
    if library is not None:
        mode = ctypes.c_int(RELAXED_CAPTURE_MODE)
        library.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode))


def _done(event) -> bool:
    try:
        return bool(event.query())
    except RuntimeError:  # a broken device: pending for ever, the watchdog decides
        return False


def commit_mark(watch: Optional[DeviceWatch], board) -> Optional[DeviceWatch]:
    """At a commit: mark the device work, starting the watch once the worker uses CUDA."""
    if watch is None:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None  # a CPU worker: nothing to watch, no thread
        device = torch.cuda.current_device()
        watch = DeviceWatch(board, probe_stream=torch.cuda.default_stream(device), device=device)
    watch.on_commit()
    return watch


def _cuda_event():
    import torch

    return torch.cuda.Event()
