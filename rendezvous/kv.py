"""What etcd returns for a key, and the key-value interface the rendezvous's recipes need.

``Etcd`` (etcd.py) satisfies ``Kv``; so does the in-memory store of the unit tests
(tests/fakes/kv.py), which lets the coordinator's leader loop be tested without a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_proto(cls, kv) -> "KeyValue":
        return cls(kv.key.decode("utf-8"), bytes(kv.value), kv.create_revision, kv.mod_revision, kv.version, kv.lease)


class Cancellable(Protocol):
    def cancel(self, timeout: float = 5.0) -> None: ...


class Kv(Protocol):
    """Keys, one transaction type (comparisons of value, create and mod revisions; puts
    and deletes: etcd.py's dataclasses), leases and resumable watches. A watch calls
    ``on_events`` with events that have ``.type`` ("put" or "delete") and ``.kv``, in
    revision order, and ``on_reset`` when events may have been lost (compaction)."""

    def get(self, key: str, *, retry_deadline: Optional[float] = None) -> Optional[KeyValue]: ...

    def get_prefix(self, prefix: str, *, retry_deadline: Optional[float] = None) -> tuple[list[KeyValue], int]: ...

    def put(self, key: str, value: bytes, lease: Optional[int] = None, *, retry_deadline: Optional[float] = None) -> int: ...

    def delete(self, key: str) -> bool: ...

    def txn(self, compare: Sequence, success: Sequence, failure: Sequence = ()) -> tuple[bool, int]: ...

    def grant_lease(self, ttl: float) -> int: ...

    def refresh_lease(self, lease_id: int) -> float: ...

    def revoke_lease(self, lease_id: int, *, retry_deadline: Optional[float] = None) -> None: ...

    def watch(self, key: str, *, prefix: bool, start_revision: int, on_events: Callable,
              on_reset: Optional[Callable] = None) -> Cancellable: ...
