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
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

POLL_S = 0.25  # like the heartbeat: the agent's bounds are seconds
MAX_PENDING = 64  # events kept; the oldest pending one is what counts


class DeviceWatch:
    """``on_commit()`` on the main thread; a daemon thread writes ``board.device_pending``."""

    def __init__(self, board, make_event: Optional[Callable[[], object]] = None, *,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = POLL_S, start: bool = True,
                 probe_stream=None):
        self._board = board
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
        return since

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll()


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
        watch = DeviceWatch(board, probe_stream=torch.cuda.default_stream(torch.cuda.current_device()))
    watch.on_commit()
    return watch


def _cuda_event():
    import torch

    return torch.cuda.Event()
