"""An in-memory etcd for unit tests: keys with revisions, one kind of transaction,
leases and watches, satisfying ``elastic.rendezvous.kv.Kv``.

Watches are served by one dispatcher thread, in revision order, as etcd's are: a
handler never runs on the writer's thread, so it may take the locks the writer holds.
``flush()`` waits until every event written so far has been handed to its watches.
Leases never expire by themselves; ``expire(lease)`` is the TTL running out.
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from elastic.rendezvous.errors import LeaseLostError, RendezvousError
from elastic.rendezvous.etcd import CreateRevisionEquals, Delete, ModRevisionEquals, Put
from elastic.rendezvous.kv import KeyValue


@dataclass(frozen=True)
class Event:
    type: str  # "put" or "delete"
    kv: KeyValue


class _Watch:
    def __init__(self, owner: "MemoryKv", key: str, prefix: bool, on_events: Callable):
        self._owner, self.key, self.prefix, self.on_events = owner, key, prefix, on_events
        self.cancelled = False

    def matches(self, key: str) -> bool:
        return key.startswith(self.key) if self.prefix else key == self.key

    def cancel(self, timeout: float = 5.0) -> None:
        self.cancelled = True
        self._owner._forget(self)


class MemoryKv:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._data: dict[str, KeyValue] = {}
        self._history: list[tuple[int, Event]] = []
        self._revision = 1
        self._leases: dict[int, set[str]] = {}
        self._lease_ids = itertools.count(0x1000)
        self._watches: list[_Watch] = []
        self._outbox: "queue.Queue[Optional[tuple[_Watch, list[Event]]]]" = queue.Queue()
        self._dispatcher = threading.Thread(target=self._dispatch, name="memory-kv-watches", daemon=True)
        self._dispatcher.start()
        self.requests = 0  # every call, as Etcd counts them

    # -- reads ---------------------------------------------------------------
    def get(self, key: str, **_) -> Optional[KeyValue]:
        with self._lock:
            self.requests += 1
            return self._data.get(key)

    def get_prefix(self, prefix: str, **_) -> tuple[list[KeyValue], int]:
        with self._lock:
            self.requests += 1
            return [self._data[k] for k in sorted(self._data) if k.startswith(prefix)], self._revision

    # -- writes --------------------------------------------------------------
    def put(self, key: str, value: bytes, lease: Optional[int] = None, **_) -> int:
        ok, revision = self.txn([], [Put(key, value, lease)])
        return revision

    def delete(self, key: str) -> bool:
        with self._lock:
            present = key in self._data
        self.txn([], [Delete(key)])
        return present

    def txn(self, compare: Sequence, success: Sequence, failure: Sequence = (), **_) -> tuple[bool, int]:
        with self._lock:
            self.requests += 1
            won = all(self._holds(c) for c in compare)
            operations = success if won else failure
            for op in operations:
                if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                    raise RendezvousError("etcdserver: requested lease not found")
            if any(isinstance(op, Put) or op.key in self._data for op in operations):
                self._revision += 1
                self._publish([self._apply(op) for op in operations])
            return won, self._revision

    def _holds(self, cmp) -> bool:
        kv = self._data.get(cmp.key)
        if isinstance(cmp, CreateRevisionEquals):
            return (0 if kv is None else kv.create_revision) == cmp.revision
        if isinstance(cmp, ModRevisionEquals):
            return (0 if kv is None else kv.mod_revision) == cmp.revision
        raise TypeError(f"not a txn comparison: {cmp!r}")

    def _apply(self, op) -> Optional[Event]:
        old = self._data.get(op.key)
        if old is not None and old.lease in self._leases:
            self._leases[old.lease].discard(op.key)
        if isinstance(op, Delete):
            if old is None:
                return None
            del self._data[op.key]
            return Event("delete", KeyValue(op.key, b"", 0, self._revision, 0, 0))
        kv = KeyValue(op.key, op.value, old.create_revision if old else self._revision, self._revision,
                      old.version + 1 if old else 1, op.lease or 0)
        self._data[op.key] = kv
        if op.lease:
            self._leases[op.lease].add(op.key)
        return Event("put", kv)

    # -- leases --------------------------------------------------------------
    def grant_lease(self, ttl: float, **_) -> int:
        with self._lock:
            self.requests += 1
            lease = next(self._lease_ids)
            self._leases[lease] = set()
            return lease

    def refresh_lease(self, lease_id: int, **_) -> float:
        with self._lock:
            self.requests += 1
            if lease_id not in self._leases:
                raise LeaseLostError(f"etcd lease {lease_id:x} expired or was revoked")
            return 60.0

    def revoke_lease(self, lease_id: int, **_) -> None:
        with self._lock:
            keys = self._leases.pop(lease_id, set())
            if keys:
                self.txn([], [Delete(k) for k in sorted(keys)])

    expire = revoke_lease  # the TTL ran out: the same effect, nobody asked

    def lease_time_to_live(self, lease_id: int) -> float:
        with self._lock:
            return 60.0 if lease_id in self._leases else -1.0

    # -- watches -------------------------------------------------------------
    def watch(self, key: str, *, prefix: bool, start_revision: int, on_events: Callable,
              on_reset: Optional[Callable] = None) -> _Watch:
        with self._lock:
            watch = _Watch(self, key, prefix, on_events)
            self._watches.append(watch)
            missed = [e for revision, e in self._history if revision >= start_revision and watch.matches(e.kv.key)]
            if missed:
                self._outbox.put((watch, missed))
            return watch

    def _forget(self, watch: _Watch) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)

    def _publish(self, events: list[Optional[Event]]) -> None:
        events = [e for e in events if e is not None]
        self._history.extend((self._revision, e) for e in events)
        for watch in self._watches:
            mine = [e for e in events if watch.matches(e.kv.key)]
            if mine:
                self._outbox.put((watch, mine))

    def _dispatch(self) -> None:
        while True:
            item = self._outbox.get()
            try:
                if item is None:
                    return
                watch, events = item
                if not watch.cancelled:
                    watch.on_events(events)
            finally:
                self._outbox.task_done()

    def flush(self) -> None:
        """Until every event written so far was handed to its watches."""
        self._outbox.join()

    def close(self) -> None:
        self._outbox.put(None)
        self._dispatcher.join(5.0)
