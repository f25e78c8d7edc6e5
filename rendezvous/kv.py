"""What etcd returns for a key: shared by the client (``etcd.py``) and its watches."""

from __future__ import annotations

from dataclasses import dataclass


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
