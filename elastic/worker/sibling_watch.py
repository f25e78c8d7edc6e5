"""A worker of this host that dies breaks the ring now, not when the kernel is done with it.

Each worker holds its life lock (``life_lock.py``) and watches those of the other
workers of its host that share its ring. When one starts to exit without an exit
record (a SIGKILL, a crash, the OOM killer: its agent will replace it), this worker
aborts its ring at once, which fails every survivor's pending collective on every
host (ring_abort.py), and asks for a round without it: a reset request naming it
lost, which the coordinator answers at once (``rendezvous/rounds.py``). Both used to
wait until the dead process's memory was freed: its sockets close, and its agent's
``waitpid`` returns, only then (0.05-0.4 s on a loaded 2-core host; issue 30).

A worker that exits with a record (it finished, failed in user code, or left a
broken process's report) is its agent's to judge, as is one no longer in the newest
plan (it left gracefully) or one that leaves a job that is stopping.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Optional

from elastic.rendezvous import STOPPING, RendezvousError, RoundPlan

from ..contract.console import FILE_ONLY
from ..contract.faults import read_record
from . import life_lock

log = logging.getLogger(__name__)


class SiblingWatch:
    def __init__(self, worker_id: str, member_id: str, marker_file: str, error_file: str, control,
                 ring_plan: Callable[[], Optional[RoundPlan]], abort: Callable[[], None],
                 emit: Callable[..., None] = lambda *a, **k: None):
        self._worker_id = worker_id
        self._member_id = member_id
        self._dir = os.path.dirname(marker_file)
        self._error_dir = os.path.dirname(error_file)
        self._control = control
        self._ring_plan = ring_plan
        self._abort = abort
        self._emit = emit
        self._lock = threading.Lock()
        self._watched: set[str] = set()
        self.held = life_lock.hold(life_lock.path_for(self._dir, worker_id))

    def arm(self, plan: RoundPlan) -> None:
        """Watch the other workers of this host in ``plan`` (call once its ring formed:
        each of them holds its lock by then)."""
        if not self.held:
            return  # no robust mutexes here: nobody else's either
        for worker in plan.local_ranks(self._member_id):
            with self._lock:
                if worker == self._worker_id or worker in self._watched:
                    continue
                self._watched.add(worker)
            if not life_lock.watch(life_lock.path_for(self._dir, worker), lambda w=worker: self._on_death(w),
                                   name=f"elastic-life-watch:{worker}"):
                with self._lock:
                    self._watched.discard(worker)

    def _on_death(self, worker: str) -> None:
        """Watcher thread: ``worker``'s process is exiting."""
        with self._lock:
            self._watched.discard(worker)
        ring, newest, status = self._ring_plan(), self._control.plan, self._control.status
        if status.over or status.state == STOPPING:
            return
        if ring is None or ring.rank_of(worker) is None or newest is None or newest.rank_of(worker) is None:
            return  # not in our ring, or it left it gracefully
        if read_record(os.path.join(self._error_dir, f"{worker}.error")) is not None:
            return  # it said how it ended: its agent decides
        log.info("round %d: worker %s is exiting without a record: aborting the ring, asking for a round without it",
                 ring.round, worker, extra=FILE_ONLY)
        self._abort()
        # Dates the failure in the timeline: its agent's worker_exited comes only once
        # the process is gone, often after the ring trains again (timeline/model.py).
        self._emit("sibling_exiting", console=False, dying=worker)
        try:
            self._control.request_reset(f"{self._worker_id}.sibling", ring.round, f"worker {worker} died",
                                        lost=(worker,))
        except RendezvousError as exc:  # its agent reports it too, once the process is gone
            log.info("could not ask for a round without %s: %s", worker, exc, extra=FILE_ONLY)
