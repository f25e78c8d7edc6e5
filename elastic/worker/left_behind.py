"""The left-behind check of commits: a worker the job left behind completes no commit in a round
that is over.

Left behind: a worker of round r that a later plan declares lost (its host was paused
or cut off past its lease's TTL, or it was declared hung). Its ring is gone (the
survivors shut their connections to it and went on from their last common commit),
so its next commit is refused with ``LeftBehind``: a failure of its ring for the
recovery path, which rolls it back and waits for a round that includes it again
(its agent registers again, with the same worker ids, once it reaches etcd); the
sync then hands it the newest commit.

Asked at every commit, it costs nothing in the common case: it reads the plan the
control watch caches, and etcd is never on the per-step path. That view can be stale
exactly when it matters: a process that was paused (a paused VM, SIGSTOP of its host)
resumes all its threads at once, and the main thread may reach its commit before the
watch thread has read what etcd sent meanwhile (seen: a commit of the old round 1 s
after the survivors moved on). So the check notices pauses: a thread ticks every
``TICK_S``; a gap between two ticks, or a tick overdue at the commit, longer than a
quarter of the TTL (a lease cannot run out in less) means this process did not run
for a while. Only then are the plans since round r read from etcd (bounded, short);
if etcd cannot say, the cached view decides (an etcd outage must not stop training).
An honest long step is no pause: the ticks go on during it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from elastic.rendezvous import Etcd, JobKeys, MalformedValueError, RendezvousError, RoundPlan

from ..contract.errors import LeftBehind
from ..contract.timeouts import pause_threshold

log = logging.getLogger(__name__)

READ_DEADLINE_S = 2.0  # the etcd reads after a pause: a commit waits at most about this
TICK_S = 0.25


class LeftBehindCheck:
    def __init__(self, etcd: Etcd, keys: JobKeys, worker: str, ttl: float, *, ticking: bool = True,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self._etcd, self._keys, self._worker = etcd, keys, worker
        self._pause_s = pause_threshold(ttl)
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self._last_tick = self._now()
        self._longest_gap = 0.0  # between two ticks, since the last check
        self._stop = threading.Event()
        if ticking:
            threading.Thread(target=self._tick_on, name="elastic-pause-clock", daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def tick(self) -> None:
        now = self._now()
        with self._lock:
            self._longest_gap = max(self._longest_gap, _gap(self._last_tick, now))
            self._last_tick = now

    def reset(self) -> None:
        """The ring was just (re-)entered: our view of the job is current."""
        with self._lock:
            self._longest_gap = 0.0

    def check(self, round_number: int, cached: Optional[RoundPlan]) -> None:
        """Raise LeftBehind if the job left ``round_number`` without this worker."""
        with self._lock:
            paused = max(self._longest_gap, _gap(self._last_tick, self._now()))
            self._longest_gap = 0.0
        why = _lost_in(cached, self._worker) if cached is not None and cached.round > round_number else None
        if why is None and paused > self._pause_s:
            why = self._read_afresh(round_number, paused)
        if why is not None:
            raise LeftBehind(f"worker {self._worker} left behind in round {round_number}: {why}")

    def _read_afresh(self, round_number: int, paused: float) -> Optional[str]:
        try:
            plan_kv = self._etcd.get(self._keys.plan, retry_deadline=READ_DEADLINE_S)
            newest = RoundPlan.from_json(plan_kv.value) if plan_kv is not None else None
            if newest is None or newest.round <= round_number:
                return None
            kvs, _ = self._etcd.get_prefix(self._keys.prefix + "rounds/", retry_deadline=READ_DEADLINE_S)
        except RendezvousError as exc:
            log.info("round %d: this process did not run for %.1fs and etcd cannot say what happened meanwhile "
                     "(%s); going on", round_number, paused, exc)
            return None
        for plan in [*readable_plans(kvs), newest]:
            if plan.round > round_number:
                why = _lost_in(plan, self._worker)
                if why is not None:
                    return why
        return None

    def _now(self) -> tuple[float, float]:
        return self._clock(), self._wall()

    def _tick_on(self) -> None:
        while not self._stop.wait(TICK_S):
            self.tick()


def _gap(since: tuple[float, float], now: tuple[float, float]) -> float:
    # Both clocks: a paused VM may not see its monotonic clock advance.
    return max(now[0] - since[0], now[1] - since[1])


def _lost_in(plan: RoundPlan, worker: str) -> Optional[str]:
    return f"round {plan.round} declared it lost" if worker in plan.lost else None


def readable_plans(kvs) -> list:
    """The kept rounds' plans that parse (an unreadable one says nothing of this worker)."""
    plans = []
    for kv in kvs:
        try:
            plans.append(RoundPlan.from_json(kv.value))
        except MalformedValueError:
            continue
    return plans
