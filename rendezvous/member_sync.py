"""A client that follows etcd's members: when the host it first reached is lost, it
talks to the others.

A job on bare metal reaches its rendezvous at one address (``--rdzv-endpoint
node0:29400``), but once three hosts are in the job its etcd has members on three of
them (served.py), and the endpoint's host may be the one lost. So every client of such
an etcd (each agent, each worker) reads the member list every few seconds and makes
the members' client URLs its endpoints (``Etcd.set_endpoints``): its requests fail
over to a live member, as with a list given on the command line. Learners are left
out (they serve no requests); an empty or failed read changes nothing.
"""

from __future__ import annotations

import logging
import threading

from .cluster_rpc import member_list
from .errors import RendezvousError
from .etcd import Etcd

log = logging.getLogger(__name__)


def endpoints_of(members) -> tuple[tuple[str, int], ...]:
    """The client endpoints of the started voting members, in the list's order."""
    found: list[tuple[str, int]] = []
    for member in members:
        if member.started and not member.is_learner:
            found += [e for e in member.client_endpoints() if e[0] and e not in found]
    return tuple(found)


class MemberSync:
    """A daemon thread: every ``interval`` s, the client's endpoints := the members'."""

    def __init__(self, etcd: Etcd, interval: float):
        self._etcd = etcd
        self._interval = interval

    def start(self) -> "MemberSync":
        threading.Thread(target=self._run, name="etcd-member-sync", daemon=True).start()
        return self

    def sync_once(self) -> None:
        endpoints = endpoints_of(member_list(self._etcd, deadline=self._interval))
        if endpoints:
            self._etcd.set_endpoints(endpoints)

    def _run(self) -> None:
        while not self._etcd.closed:
            try:
                self.sync_once()
            except RendezvousError as exc:
                log.debug("etcd member list not read: %s", exc)
            except Exception as exc:  # noqa: BLE001 - a daemon that must not die on a surprise
                log.warning("etcd member list not read: %r", exc)
            self._etcd._closed.wait(self._interval)


def follow_members(etcd: Etcd) -> Etcd:
    """Start following etcd's member list if the client's config asks for it (member_sync > 0)."""
    if etcd.config.member_sync:
        MemberSync(etcd, etcd.config.member_sync).start()
    return etcd
