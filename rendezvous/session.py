"""Session: one etcd lease kept alive by a daemon thread (etcd's concurrency recipe).

Keys that must vanish when this process or host dies are put with
`session.lease_id`. The keep-alive refreshes every ttl/3 and rides out etcd
being away (restart, leader change): etcd keeps leases across a restart and
extends them when a new leader takes over, so a refresh after the outage
usually just works.

If a refresh says the lease is gone (etcd was away longer than the TTL, or
someone revoked it), the session grants a fresh lease and calls
`on_new_lease(new_id)` so owners put their keys again. When that cannot be
done within the TTL, or etcd stays unreachable past max(ttl, retry_deadline),
`lost` is set with `lost_reason`: owners must treat their keys as gone.

A lost session does not give up: a host cut off from etcd (a partition) comes
back when its link does. It keeps trying, at a slower pace, to grant a new lease;
when that works it calls `on_new_lease` (the owner registers again) and clears
`lost`. `restored` counts those returns.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable

from .errors import ConfigError, LeaseLostError, RendezvousError
from .etcd import Etcd

log = logging.getLogger(__name__)

_CLOSE_DEADLINE_S = 3.0

# After a failed refresh, try again this soon (capped by ttl/3): the sooner we
# reach a restarted etcd, the more of the TTL is left.
_RETRY_INTERVAL = 0.25


class Session:
    def __init__(
        self,
        etcd: Etcd,
        ttl: float,
        *,
        on_new_lease: Callable[[int], None] | None = None,
        name: str = "",
    ):
        if not isinstance(ttl, (int, float)) or not ttl > 0 or math.isinf(ttl):
            raise ConfigError(f"invalid session ttl {ttl!r}: must be a positive number of seconds")
        self._etcd = etcd
        self.ttl = float(ttl)
        self.name = name
        self._on_new_lease = on_new_lease
        self._interval = self.ttl / 3
        self.lost = threading.Event()
        self.lost_reason: str | None = None
        self.renewals = 0  # fresh leases granted after the first (tests, metrics)
        self.restored = 0  # times the session came back after being lost
        # When a refresh last got through after failing (time.monotonic()): etcd was away
        # until then, and other members' refreshes may not have got through yet.
        self.back_at: float | None = None
        self._needs_new_lease = False
        self._stopped = threading.Event()
        self.lease_id: int = etcd.grant_lease(self.ttl)
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-session:{name or format(self.lease_id, 'x')}", daemon=True
        )
        self._thread.start()
        log.debug("session %s: lease %x (ttl %gs)", self.name, self.lease_id, self.ttl)

    # -- public

    def close(self) -> None:
        """Stop the keep-alive and revoke the lease: its keys vanish at once."""
        self._stop()
        try:
            # Bounded and short: if etcd is away, the keys still vanish when the TTL
            # runs out, so a process on its way out should not wait long for it.
            self._etcd.revoke_lease(
                self.lease_id, retry_deadline=min(self._etcd.config.retry_deadline, self.ttl, _CLOSE_DEADLINE_S)
            )
        except RendezvousError as exc:
            # Harmless (the keys expire on their own), so not a warning at the end of a run.
            log.info("session %s: could not revoke lease %x (%s); its keys expire within %gs",
                        self.name, self.lease_id, exc, self.ttl)

    def orphan(self) -> None:
        """Stop the keep-alive only; the keys vanish when the TTL runs out."""
        self._stop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session({self.name!r}, lease={self.lease_id:x}, ttl={self.ttl:g}s, lost={self.lost.is_set()})"

    # -- keep-alive thread

    def _stop(self) -> None:
        self._stopped.set()
        if threading.current_thread() is not self._thread:
            # One refresh attempt is bounded by ttl/3 plus one call timeout.
            self._thread.join(self._interval + self._etcd.config.call_timeout + 1.0)

    def _run(self) -> None:
        trouble_since: float | None = None  # start of the current run of failures
        wait = self._interval
        while not self._stopped.wait(wait):
            try:
                self._keep_alive_once()
            except RendezvousError as exc:
                now = time.monotonic()
                trouble_since = trouble_since if trouble_since is not None else now
                if self._needs_new_lease:
                    limit, what = self.ttl, f"could not re-establish lease {self.lease_id:x}"
                else:
                    limit = max(self.ttl, self._etcd.config.retry_deadline)
                    what = f"could not refresh lease {self.lease_id:x}"
                if now - trouble_since > limit and not self.lost.is_set():
                    self._declare_lost(f"{what} for {now - trouble_since:.1f}s: {exc}")
                    # Our lease is as good as gone: from now on only a new one helps.
                    self._needs_new_lease = True
                level = logging.INFO if now == trouble_since else logging.DEBUG  # once per outage
                log.log(level, "session %s: %s (%s); retrying", self.name, what, exc)
                wait = self._interval if self.lost.is_set() else min(self._interval, _RETRY_INTERVAL)
            else:
                if trouble_since is not None:
                    self.back_at = time.monotonic()
                trouble_since, wait = None, self._interval
                if self.lost.is_set():
                    self.restored += 1
                    self.lost_reason = None
                    self.lost.clear()
                    log.warning("session %s: back on lease %x after being lost", self.name, self.lease_id)

    def _keep_alive_once(self) -> None:
        if not self._needs_new_lease:
            try:
                self._etcd.refresh_lease(self.lease_id, retry_deadline=self._interval)
                return
            except LeaseLostError:
                log.warning("session %s: lease %x expired; granting a new one and re-registering",
                            self.name, self.lease_id)
                self._needs_new_lease = True
        new_lease = self._etcd.grant_lease(self.ttl, retry_deadline=self._interval)
        given_up, self.lease_id = self.lease_id, new_lease
        if self._on_new_lease is not None:
            try:
                self._on_new_lease(new_lease)
            except Exception as exc:
                # Half-registered keys must not linger on a lease we will replace.
                try:
                    self._etcd.revoke_lease(new_lease, retry_deadline=self._interval)
                except RendezvousError:
                    pass
                self.lease_id = given_up  # still the one to revoke once a new lease holds
                raise RendezvousError(f"re-registering on new lease {new_lease:x} failed: {exc}") from exc
        self._needs_new_lease = False
        self.renewals += 1
        log.info("session %s: now on lease %x", self.name, new_lease)
        # etcd extends every lease when it restarts (and a healed link may beat the TTL),
        # so the lease we gave up can still be alive, holding what we put on it that the
        # owner did not put again (our coordinator election key: nobody, we included,
        # could lead until it expired, a whole TTL after etcd returned). Gone it is.
        try:
            self._etcd.revoke_lease(given_up, retry_deadline=self._interval)
        except RendezvousError as exc:
            log.info("session %s: could not revoke the old lease %x (%s); it expires within %gs",
                     self.name, given_up, exc, self.ttl)

    def _declare_lost(self, reason: str) -> None:
        self.lost_reason = reason
        log.error("session %s: lease lost: %s", self.name, reason)
        self.lost.set()
