"""Step records: which commits a worker made, and when, for the timeline picture.

A worker does not write a line per step: at high step rates (thousands per second
over a week) that would be gigabytes. It writes one ``steps`` event per span of
commits instead, and closes a span

* once it is ``SPAN_S`` old (so a running job writes about one short line per
  worker per second, ~200 bytes, whatever its step rate), and
* at every change of ring (``close()`` from the recovery path), so a re-formation
  shows as a gap with exact edges.

A span's ``start`` is the end of the previous span (or the entry into the round),
so consecutive spans touch and only real pauses show. The span open when a worker
is SIGKILLed (at most ``SPAN_S`` of steps) is lost with it; its agent's
``worker_exited`` event marks the moment it died.

Per commit the cost is one ``time.time()`` and a comparison.
"""

from __future__ import annotations

import time
from typing import Optional

SPAN_S = 1.0  # seconds of commits per ``steps`` event


class StepLog:
    def __init__(self, events, worker_id: str):
        self._events = events
        self._worker = worker_id
        self._start: Optional[float] = None  # wall time the open span began
        self._first: Optional[int] = None  # first commit number of the open span
        self._last: Optional[int] = None
        self._last_at = 0.0
        self._world = 0

    def begin(self) -> None:
        """The training function is (re-)entered: the next commit's work starts now."""
        self.close()
        self._start = time.time()

    def commit(self, number: Optional[int], world_size: int) -> None:
        now = time.time()
        if self._start is None:
            self._start = now
        if number is None:
            number = (self._last or 0) + 1
        if self._first is None:
            self._first = number
        self._last, self._last_at, self._world = number, now, world_size
        if now - self._start >= SPAN_S:
            self.close()
            self._start = now

    def close(self) -> None:
        """Write the open span, if any commit was made in it."""
        if self._first is not None:
            self._events.emit(
                "steps", worker=self._worker, first=self._first, last=self._last,
                start=round(self._start, 4), end=round(self._last_at, 4), world_size=self._world,
            )
        self._start = self._first = self._last = None
