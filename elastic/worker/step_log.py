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

A span also carries what ``elastic-run status`` needs to say how far the job has got
(the agent of rank 0 publishes it: ``elastic/agent/run_watch.py``), read once per
span, never per step: the steps the script said it will make (``elastic.report``),
and the samples its ``ElasticSampler`` has marked processed this epoch, of how many.
"""

from __future__ import annotations

import time
from typing import Any, Optional

SPAN_S = 1.0  # seconds of commits per ``steps`` event

# What the script said of its run (``report``); read when a span is written.
_reported: dict[str, int] = {}


def report(total_steps: Optional[int] = None, samples_per_step: Optional[int] = None) -> None:
    """Tell ``elastic-run status`` how long the run is: ``total_steps`` commits in all (it
    then shows the time left), and ``samples_per_step`` samples per commit over the whole
    ring (for samples per second when no ``ElasticSampler`` counts them). Optional; call
    it on any rank, before or inside the training function, again when it changes."""
    for name, value in (("total_steps", total_steps), ("samples_per_step", samples_per_step)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"elastic.report: {name} must be a positive integer, got {value!r}")
        _reported[name] = value


class StepLog:
    def __init__(self, events, worker_id: str):
        self._events = events
        self._worker = worker_id
        self._start: Optional[float] = None  # wall time the open span began
        self._first: Optional[int] = None  # first commit number of the open span
        self._last: Optional[int] = None
        self._last_at = 0.0
        self._world = 0
        self.sampler: Any = None  # the state's ElasticSampler, set by TorchState.on_reset

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
                **self._extent(),
            )
        self._start = self._first = self._last = None

    def _extent(self) -> dict[str, int]:
        """How far along the run is, as far as the script or its sampler says."""
        out = dict(_reported)
        sampler = self.sampler
        try:
            if sampler is not None:
                out.update(samples=int(sampler.processed_count), epoch_samples=int(sampler.length),
                           epoch=int(sampler.epoch))
        except (AttributeError, TypeError, ValueError):
            pass  # not an ElasticSampler: no sample counts
        return out
