"""A job you can watch: the agent publishes its run's progress for ``elastic-run status``
and prints what the run cost at its end.

Fed with the events the agent reads anyway (``Agent._observe``), nothing per step:

* progress: the agent whose worker is rank 0 turns that worker's ``steps`` events
  into a ``JobProgress`` (``elastic/timeline/progress.py``) and a thread of its own
  puts it at the job's ``progress`` key in etcd (on the job lease, so it ends with the job
  and stays in its history) every ``PUBLISH_S`` when it changed. A slow or absent
  etcd delays that thread only, never the agent's loop;
* the end-of-run summary (``elastic/timeline/summary.py``): from a compact record
  of the run, the events the timeline model reads with each worker's step spans
  merged per round, so a week-long run keeps a few thousand records, not a line
  per second.

It also hands the events to ``--chaos-kill-every``'s monkey and prints its report. The
agent builds it with what it needs, by name: how to publish (``publish``, on the job's
lease) and the monkey.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Optional

from ..timeline.model import build
from ..timeline.progress import WINDOW_S, progress_of
from ..timeline.summary import failures_lost, summarize

log = logging.getLogger(__name__)

PUBLISH_S = 1.0  # one small put a second per job: the step records come as often
# The events the timeline model reads (besides steps).
_KEPT = frozenset({
    "agent_started", "worker_started", "worker_exited", "failure_detected", "hang_detected", "reform_done",
    "round_formed", "round_started", "member_joined", "member_left", "graceful_leave", "job_finished",
})


class RunRecord:
    """The run's events, compact: steps spans merged per worker and round."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._open: dict[str, dict] = {}  # worker -> its newest merged steps span

    def add(self, event: dict) -> None:
        kind = event.get("event")
        if kind in _KEPT:
            self.events.append(event)
        elif kind == "steps" and event.get("worker"):
            span = self._open.get(event["worker"])
            if span is not None and span.get("round") == event.get("round") and \
                    span.get("last", 0) + 1 == event.get("first") and span.get("end", 0) <= event.get("start", 0):
                span.update(last=event["last"], end=event.get("end"), time=event.get("time"))
                return
            merged = dict(event)
            self._open[event["worker"]] = merged
            self.events.append(merged)


class RunWatch:
    def __init__(self, *, job_id: str, log_dir: Optional[str], publish: Callable[[bytes], None],
                 chaos=None, out: Callable[[str], None] = print):
        self._job_id = job_id
        self._log_dir = log_dir
        self._publish = publish
        self._chaos = chaos
        self._out = out
        self.record = RunRecord()
        self._spans: deque = deque()  # rank 0's recent steps events (this host's, if it holds rank 0)
        self._latest: Optional[bytes] = None
        self._sent: Optional[bytes] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def on_event(self, event: dict) -> None:
        if self._chaos is not None:
            self._chaos.on_event(event)
        self.record.add(event)
        if event.get("event") == "steps" and event.get("rank") == 0 and isinstance(event.get("last"), int):
            self._spans.append(event)
            while self._spans and self._spans[0].get("end", 0) < event.get("end", 0) - WINDOW_S:
                self._spans.popleft()
            self._offer()

    def _offer(self) -> None:
        try:
            failures, lost, rerun = failures_lost(build(self.record.events))
        except ValueError:
            failures, lost, rerun = 0, 0.0, 0
        progress = progress_of(list(self._spans), failures=failures, lost_s=round(lost, 3), rerun_steps=rerun)
        if progress is None:
            return
        with self._lock:
            self._latest = progress.to_json()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elastic-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        failed = False
        while True:
            with self._lock:
                value = self._latest
            if value is not None and value != self._sent:
                try:
                    self._publish(value)
                    self._sent, failed = value, False
                except Exception as exc:  # etcd away: the next turn tries the newest value again
                    if not failed:
                        log.debug("cannot publish progress yet: %s", exc)
                    failed = True
            if self._stop.wait(PUBLISH_S):
                return

    def finish(self, last_events=()) -> Optional[str]:
        """The run is over: the chaos report, if any, then the run's summary (printed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)  # a put under way; one stuck on an absent etcd is left behind
        last_events = list(last_events)
        if self._chaos:
            self._chaos.finish(last_events)
        for event in last_events:
            self.record.add(event)
        try:
            timeline = build(self.record.events)
        except ValueError:
            return None  # no event at all: nothing ran
        text = summarize(timeline, job_id=self._job_id, log_dir=self._log_dir)
        self._out(text)
        return text
