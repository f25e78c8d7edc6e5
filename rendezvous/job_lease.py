"""The job lease: what makes the keys of an abandoned job expire.

Plans, rounds, the status, reset requests and plain-store addresses must outlive any
one member, so they cannot hang on a member's lease. Without any lease they outlived
the job too: when every agent was killed at once (pods force-deleted, a node pool
removed) nobody was left to clean up, and on a shared etcd enough abandoned jobs fill
its quota, after which no job on it can re-form (security review, finding 10).

So they hang on one long lease of the job's own (``JobKeys.job_lease`` holds its id, on
itself). The coordinator takes or grants it when it starts to lead and refreshes it
every ``JOB_LEASE_REFRESH_S``: while any agent lives the keys stay; a week after the last
one died they are gone. An ended job's history moves onto its own 24 h lease and the job
lease is revoked (history.py).
"""

from __future__ import annotations

import logging
from typing import Optional

from .errors import LeaseLostError, MalformedValueError, RendezvousError
from .etcd import ModRevisionEquals, Put
from .keys import JOB_LEASE_REFRESH_S, JobKeys
from .kv import Kv

log = logging.getLogger(__name__)


def lease_missing(exc: RendezvousError) -> bool:
    """Did etcd refuse a write because the lease it names is gone (revoked when the job
    ended, or expired)? The writer then writes without it, or takes a new one."""
    return "lease not found" in str(exc)


def put_on_job_lease(etcd: Kv, key: str, value: bytes, lease: Optional[int], *,
                     retry_deadline: Optional[float] = None) -> None:
    """Put ``key`` on the job lease; without it when the lease is gone (the job ended)."""
    try:
        etcd.put(key, value, lease=lease, retry_deadline=retry_deadline)
    except RendezvousError as exc:
        if not lease_missing(exc):
            raise
        etcd.put(key, value, retry_deadline=retry_deadline)


def parse_job_lease(value: bytes) -> int:
    try:
        lease = int(value.decode("ascii"), 16)
    except (UnicodeDecodeError, ValueError):
        raise MalformedValueError(f"malformed job lease {value[:40]!r}") from None
    if lease <= 0:
        raise MalformedValueError(f"malformed job lease {value[:40]!r}")
    return lease


def ensure_job_lease(etcd: Kv, keys: JobKeys, ttl: float) -> int:
    """The job's lease id: the one in etcd, else a new one of ``ttl`` seconds."""
    for _ in range(3):  # another coordinator may grant one at the same moment
        kv = etcd.get(keys.job_lease)
        if kv is not None and kv.lease:
            return kv.lease  # the key lives on the lease: present means alive
        lease = etcd.grant_lease(ttl)
        won, _ = etcd.txn([ModRevisionEquals(keys.job_lease, 0 if kv is None else kv.mod_revision)],
                          [Put(keys.job_lease, f"{lease:x}".encode(), lease=lease)])
        if won:
            log.debug("job %s: job lease %x (%gs)", keys.job_id, lease, ttl)
            return lease
        etcd.revoke_lease(lease)
    raise RendezvousError(f"job {keys.job_id}: could not agree on a job lease")


class JobLease:
    """A coordinator's hold on the job lease: taken when it starts to lead, refreshed
    while it leads (at most every ``JOB_LEASE_REFRESH_S``)."""

    def __init__(self, etcd: Kv, keys: JobKeys, ttl: float, clock, refresh_every: float = JOB_LEASE_REFRESH_S):
        self._etcd, self._keys, self._ttl, self._clock = etcd, keys, ttl, clock
        self._refresh_every = min(refresh_every, ttl / 3)
        self.id: Optional[int] = None
        self._refreshed_at = 0.0

    def take(self) -> int:
        self.id = ensure_job_lease(self._etcd, self._keys, self._ttl)
        self._refreshed_at = self._clock()
        return self.id

    def keep(self) -> None:
        """Refresh it when due (a lost one is taken anew); etcd errors wait for the next turn."""
        if self.id is not None and self._clock() - self._refreshed_at < self._refresh_every:
            return
        try:
            if self.id is None:
                self.take()
                return
            self._etcd.refresh_lease(self.id)
            self._refreshed_at = self._clock()
        except LeaseLostError:
            self.take()
        except RendezvousError as exc:
            log.info("job %s: job lease not refreshed yet (%s)", self._keys.job_id, exc)
