"""Who coordinates the job: one key, claimed on the claimant's lease.

etcd's own election recipe (``client/v3/concurrency/election.go``) reduced to what a
job needs: a member claims ``JobKeys.coordinator`` with one transaction that puts its id
on its lease only if the key does not exist; the key's create revision is the leader's
fencing token (every write a leader makes compares it). The others watch the key and
campaign again when it is deleted: its holder left, or its lease expired. A leader learns
it is deposed from the recipe too (``watch_deposed``), as etcd's ``Observe`` tells.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from .etcd import CreateRevisionEquals, Put
from .kv import Cancellable, Kv
from .session import Session


class Election:
    def __init__(self, etcd: Kv, key: str, member_id: str, session: Session):
        self._etcd = etcd
        self._key = key
        self._member_id = member_id
        self._session = session

    def campaign(self) -> Optional[int]:
        """Claim the key; our fencing token (its create revision) if we hold it."""
        self._etcd.txn(
            [CreateRevisionEquals(self._key, 0)],
            [Put(self._key, self._member_id.encode(), lease=self._session.lease_id)],
        )
        kv = self._etcd.get(self._key)
        if kv is None:
            return None
        if kv.value == self._member_id.encode() and kv.lease == self._session.lease_id:
            return kv.create_revision
        return None

    def wait_for_vacancy(self, stop: threading.Event, tick: Callable[[], None] = lambda: None) -> None:
        """Until the key is deleted (or ``stop``, or our session is lost); ``tick`` about
        every half second meanwhile."""
        vacant = threading.Event()

        def on_events(events):
            if any(e.type == "delete" for e in events):
                vacant.set()

        kv = self._etcd.get(self._key)
        if kv is None:
            return
        watch = self._etcd.watch(self._key, prefix=False, start_revision=kv.mod_revision + 1,
                                 on_events=on_events, on_reset=vacant.set)
        try:
            while not (vacant.is_set() or stop.is_set() or self._session.lost.is_set()):
                tick()
                vacant.wait(0.5)
        finally:
            watch.cancel()

    def watch_deposed(self, token: int, on_deposed: Callable[[], None]) -> Cancellable:
        """Call ``on_deposed`` once our claim (fencing token ``token``) is gone: the key
        deleted, or, after a compaction that may have hidden a delete, held by another
        claim. Cancel the returned watch when leading ends."""
        told = threading.Event()

        def deposed() -> None:
            if not told.is_set():
                told.set()
                on_deposed()

        def on_events(events) -> None:
            if any(e.type == "delete" for e in events):
                deposed()

        def on_reset() -> None:  # the key's history was compacted: a delete may be lost
            kv = self._etcd.get(self._key)
            if kv is None or kv.create_revision != token:
                deposed()

        return self._etcd.watch(self._key, prefix=False, start_revision=token + 1, on_events=on_events,
                                on_reset=on_reset)
