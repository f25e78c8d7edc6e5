"""A participant: what one host agent holds in the rendezvous.

It composes the recipes: a ``Session`` (lease + keep-alive), a
``MemberRegistration`` (our key), a ``ControlChannel`` (plan and status we
follow) and a ``Coordinator`` (which leads while we hold the election key).
"""

from __future__ import annotations

import logging
from typing import Optional

from .control import RUNNING, ControlChannel, JobStatus
from .coordinator import Coordinator, RoundListener
from .etcd import Etcd
from .history import keep_ended_job
from .keys import JobKeys
from .membership import MemberRegistration
from .rounds import Member, RendezvousSettings
from .session import Session

log = logging.getLogger(__name__)


class Participant:
    def __init__(
        self,
        etcd: Etcd,
        keys: JobKeys,
        settings: RendezvousSettings,
        member: Member,
        *,
        ttl: float,
        on_round: Optional[RoundListener] = None,
    ):
        self.etcd = etcd
        self.keys = keys
        self.settings = settings
        self._member = member
        self._ttl = ttl
        self._on_round = on_round
        self.session: Optional[Session] = None
        self.registration: Optional[MemberRegistration] = None
        self.control = ControlChannel(etcd, keys)
        self.coordinator: Optional[Coordinator] = None

    @property
    def member(self) -> Member:
        return self.registration.member if self.registration else self._member

    def start(self) -> "Participant":
        self.control.start()
        holder: list[MemberRegistration] = []
        self.session = Session(
            self.etcd,
            self._ttl,
            on_new_lease=lambda lease: holder and holder[0].on_new_lease(lease),
            name=self._member.member_id,
        )
        self.registration = MemberRegistration(self.etcd, self.keys, self.session, self._member)
        holder.append(self.registration)
        self.registration.register()
        self.coordinator = Coordinator(
            self.etcd,
            self.keys,
            self.session,
            self.settings,
            self._member.member_id,
            self.control,
            on_round=self._on_round,
        ).start()
        return self

    def set_workers(self, workers: tuple[str, ...], *, draining: bool = False) -> None:
        assert self.registration is not None
        self.registration.set_workers(workers, draining=draining)

    def set_status(self, status: JobStatus) -> bool:
        return self.control.set_status(status)

    def leave(self, drain_timeout: float = 0.0) -> None:
        """Graceful: withdraw our workers, then delete our key and revoke the lease.

        With ``drain_timeout``, first mark the member draining and wait (bounded)
        for a plan without our workers, so the coordinator reports them as having
        left rather than lost (a loss makes their ring partners abort the ring).
        """
        plan = self.control.plan
        if drain_timeout > 0 and self.registration is not None and plan is not None:
            mine = set(self.registration.member.workers)
            if mine & set(plan.worker_ids()):
                self.registration.set_workers((), draining=True)
                self.control.wait_for(
                    lambda p, s: s.over or (p is not None and not mine & set(p.worker_ids())),
                    drain_timeout,
                )
        if self.coordinator is not None:
            self.coordinator.stop()
        if self.registration is not None:
            self.registration.leave()
        if self.control.status.state != RUNNING:
            keep_ended_job(self.etcd, self.keys)  # readable by `elastic-run status` for a day
        if self.session is not None:
            self.session.close()
        self.control.close()

    def abandon(self) -> None:
        """Stop everything without deleting keys (the lease expiry removes them)."""
        if self.coordinator is not None:
            self.coordinator.stop()
        if self.session is not None:
            self.session.orphan()
        self.control.close()


def new_member_id(host: str) -> str:
    """Unique per registration: a restarted agent on the same host is a new member."""
    import os
    import uuid

    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in host)[:40]
    return f"{safe}-{os.getpid()}-{uuid.uuid4().hex[:6]}"

