"""The fence on commits: a worker the job left behind completes no commit in a round
that is over.

Left behind: a worker of round r that a later plan declares lost (its host was paused
or cut off past its lease's TTL, or it was declared hung). Its ring is gone (the
survivors shut their connections to it and went on from their last common commit),
so its next commit is refused with ``LeftBehind``: a failure of its ring for the
recovery path, which rolls it back and waits for a round that includes it again
(its agent registers again, with the same worker ids, once it reaches etcd); the
sync then hands it the newest commit.

Asked at every commit, it costs nothing in the common case: it reads the plan the
control watch caches. That view can be stale exactly when it matters: a process
that was paused (a paused VM, SIGSTOP of its host) resumes all its threads at once,
and the main thread may reach its commit before the watch thread has read what etcd
sent meanwhile (seen: a commit of the old round 1 s after the survivors moved on).
No lease runs out in less than the TTL, so after a gap between two commits longer
than half of it, the plans since round r are read from etcd (bounded, short). If
etcd cannot say, the cached view decides: an etcd outage must not stop training.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from rendezvous import Etcd, JobKeys, RendezvousError, RoundPlan

from .errors import LeftBehind

log = logging.getLogger(__name__)

READ_DEADLINE_S = 2.0  # the etcd reads after a long gap: a commit waits at most about this


class CommitFence:
    def __init__(self, etcd: Etcd, keys: JobKeys, worker: str, ttl: float, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self._etcd, self._keys, self._worker = etcd, keys, worker
        self._gap_s = ttl / 2
        self._clock, self._wall = clock, wall
        self._last: Optional[tuple[float, float]] = None

    def reset(self) -> None:
        """The ring was just (re-)entered: our view of the job is current."""
        self._last = (self._clock(), self._wall())

    def check(self, round_number: int, cached: Optional[RoundPlan]) -> None:
        """Raise LeftBehind if the job left ``round_number`` without this worker."""
        now = (self._clock(), self._wall())
        # Both clocks: a paused VM may not see its monotonic clock advance.
        gap = max(now[0] - self._last[0], now[1] - self._last[1]) if self._last is not None else 0.0
        self._last = now
        why = _lost_in(cached, self._worker) if cached is not None and cached.round > round_number else None
        if why is None and gap > self._gap_s:
            why = self._read_afresh(round_number, gap)
        if why is not None:
            raise LeftBehind(f"worker {self._worker} left behind in round {round_number}: {why}")

    def _read_afresh(self, round_number: int, gap: float) -> Optional[str]:
        try:
            plan_kv = self._etcd.get(self._keys.plan, retry_deadline=READ_DEADLINE_S)
            newest = RoundPlan.from_json(plan_kv.value) if plan_kv is not None else None
            if newest is None or newest.round <= round_number:
                return None
            kvs, _ = self._etcd.get_prefix(self._keys.prefix + "rounds/", retry_deadline=READ_DEADLINE_S)
        except RendezvousError as exc:
            log.info("round %d: %.1fs since the last commit and etcd cannot say what happened meanwhile (%s); "
                     "going on", round_number, gap, exc)
            return None
        for plan in [*(RoundPlan.from_json(kv.value) for kv in kvs), newest]:
            if plan.round > round_number:
                why = _lost_in(plan, self._worker)
                if why is not None:
                    return why
        return None


def _lost_in(plan: RoundPlan, worker: str) -> Optional[str]:
    return f"round {plan.round} declared it lost" if worker in plan.lost else None
