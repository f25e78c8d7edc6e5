"""Rank 0's look at a pending round's joiners: have they arrived at its store yet?

When a host joins, the coordinator publishes a round that includes its workers, but
the running ring switches to it only once they have arrived at the new round's store
(they are importing torch, loading data: seconds). Until then it keeps training, and
its rank 0 asks the new store, at its commits, how many have arrived.

That look must never hold up a step for long: the store's host may be paused or cut
off (a new plan then follows), so the client is made in one short attempt
(round_store.py), its operations time out quickly, and a store that did not answer is
asked again only a second later.

A joiner that never arrives (its worker hung in its set-up, killed later by its
agent's watchdog) leaves the ring training at its old size; that is said on the
console after 30 s, then 60, 120, ..., so that a person knows why the job did not grow.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Callable, Optional

import torch.distributed as dist

from elastic.rendezvous import RoundPlan

from ..contract import round_keys
from . import round_store

log = logging.getLogger(__name__)

ATTEMPT_S = 0.5  # one try at connecting to the pending round's store
RETRY_S = 1.0  # a store that did not answer is asked again after this long
OP_TIMEOUT_S = 2.0  # one look at the arrival counter waits at most this long
FIRST_REPORT_S = 30.0  # the first console line about joiners that have not arrived


class JoinerWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 connect: Callable[[str, int], object] = lambda host, port: round_store.client(host, port, ATTEMPT_S)):
        self._clock = clock
        self._connect = connect
        self._round: Optional[int] = None  # the pending round being watched
        self._store = None  # its store (namespace /round/<n>/), once connected
        self._since = 0.0  # when we began to wait for its joiners
        self._retry_at = 0.0
        self._report_after = FIRST_REPORT_S

    def ready(self, current: RoundPlan, pending: RoundPlan) -> bool:
        """Have all the workers that ``pending`` adds to ``current`` arrived at its store?"""
        members = set(current.worker_ids())
        joiners = [w for w in pending.worker_ids() if w not in members]
        if not joiners:
            return True
        now = self._clock()
        if self._round != pending.round:
            self._round, self._store, self._since = pending.round, None, now
            self._retry_at, self._report_after = now, FIRST_REPORT_S
        arrived = self._arrived(pending, now)
        if arrived is not None and arrived >= len(joiners):
            return True
        waited = now - self._since
        if waited >= self._report_after:
            self._report_after *= 2
            log.warning(
                "round %d: %s of %d joining worker(s) arrived within %.0fs (%s); the ring trains on at world %d "
                "meanwhile", pending.round, "?" if arrived is None else arrived, len(joiners), waited,
                ", ".join(joiners), current.world_size)
        return False

    def _arrived(self, pending: RoundPlan, now: float) -> Optional[int]:
        """The arrival counter of ``pending``'s store; None if it could not be read now."""
        if self._store is None:
            if now < self._retry_at:
                return None
            host, port = pending.store_addr.rsplit(":", 1)
            try:
                base = self._connect(host, int(port))
                base.set_timeout(datetime.timedelta(seconds=OP_TIMEOUT_S))
            except RuntimeError as exc:  # DistError is one; StoreUnanswered too
                log.debug("round %d: store %s: %s; asking again in %gs", pending.round, pending.store_addr, exc,
                          RETRY_S)
                self._retry_at = now + RETRY_S
                return None
            self._store = dist.PrefixStore(round_keys.prefix(pending.round), base)
        try:
            return self._store.add(round_keys.ARRIVED, 0)
        except RuntimeError as exc:
            log.debug("round %d: arrival counter unreadable (%s); asking again in %gs", pending.round, exc, RETRY_S)
            self._store, self._retry_at = None, now + RETRY_S
            return None
