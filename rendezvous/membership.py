"""Membership: one key per host agent, bound to its session's lease.

A graceful leave deletes the key at once; a crashed host's key disappears when
its lease runs out (the TTL). The agent rewrites its key when the set of its
workers changes (a worker crashed, a replacement was started), which is how a
crash reaches the coordinator without waiting for any TTL.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from .etcd import Etcd
from .keys import JobKeys
from .rounds import Member
from .session import Session

log = logging.getLogger(__name__)


class MemberRegistration:
    def __init__(self, etcd: Etcd, keys: JobKeys, session: Session, member: Member):
        self._etcd = etcd
        self._keys = keys
        self._session = session
        self._lock = threading.Lock()
        self._member = member
        self._registered = False

    @property
    def member(self) -> Member:
        return self._member

    def register(self) -> Member:
        with self._lock:
            self._registered = True
            return self._put(creates_key=True)

    def set_workers(self, workers: tuple[str, ...], *, draining: bool = False) -> Member:
        with self._lock:
            self._member = dataclasses.replace(self._member, workers=tuple(workers), draining=draining)
            return self._put(creates_key=False) if self._registered else self._member

    def on_new_lease(self, lease_id: int) -> None:
        """Session callback: the old lease expired (etcd was away too long)."""
        with self._lock:
            if self._registered:
                log.warning("member %s: lease renewed, re-registering", self._member.member_id)
                self._put(creates_key=True)  # the old key went with the old lease

    def leave(self) -> None:
        """Stop re-registering. The key itself goes with the session's lease, which
        the owner revokes: one request, and nothing to retry if etcd is gone."""
        with self._lock:
            self._registered = False

    def _put(self, *, creates_key: bool) -> Member:
        """One request: a put that creates the key has the key's create revision
        (member ids are unique per registration); an update keeps it."""
        key = self._keys.member(self._member.member_id)
        revision = self._etcd.put(key, self._member.to_json(), lease=self._session.lease_id)
        if creates_key:
            self._member = dataclasses.replace(self._member, revision=revision)
        return self._member
