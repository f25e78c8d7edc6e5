"""Which hosts hold the members of a job's own etcd, and the next change to make.

A bare-metal job serves its rendezvous itself (served.py): one etcd member on the
endpoint's host at first, three on three different hosts once three hosts are in the
job, so that the loss of any one host, the endpoint's included, leaves a quorum. This
module decides, as data in and one action out (like rounds.decide), tested as a table:

- a member whose host is gone (its offer expired with its lease) is removed first;
- a member added but not started yet, or a learner not promoted yet, is waited for
  (one change at a time: the quorum is never at risk while a member joins);
- a started learner is promoted;
- while there are fewer than ``size`` voting members, the next offered host that holds
  none (by address: two agents on one host are one host) gets one, as a learner where
  the server has learners (etcd 3.4+), else as a plain member.

A member that was never started and whose host is gone is removed like any other. The
last voting member is never removed: without it there is no etcd to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

MEMBERS = 3  # three members on three hosts: any one may be lost


@dataclass(frozen=True)
class Offer:
    """An agent able to hold a member: where it would listen (its lease keeps it)."""

    host_id: str
    addr: str
    client_port: int
    peer_port: int
    order: int = 0  # its key's create revision: the first to offer goes first
    tls: bool = False  # a secured served etcd: https between members and to clients

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://{_url_host(self.addr)}:{self.peer_port}"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{_url_host(self.addr)}:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"


@dataclass(frozen=True)
class Seat:
    """A member as the plan sees it: its id, name (a host id; empty until started),
    peer URL and whether it is a learner."""

    id: int
    name: str
    peer_url: str
    learner: bool = False

    @property
    def started(self) -> bool:
        return bool(self.name)


@dataclass(frozen=True)
class Remove:
    member_id: int
    why: str


@dataclass(frozen=True)
class Add:
    offer: Offer
    learner: bool


@dataclass(frozen=True)
class Promote:
    member_id: int
    name: str


@dataclass(frozen=True)
class Wait:
    why: str


Action = Remove | Add | Promote | Wait


def host_of(seat: Seat, offers: Sequence[Offer]) -> Optional[Offer]:
    """The offer a member belongs to: by name once started, else by its peer URL."""
    for offer in offers:
        if (seat.name and seat.name == offer.host_id) or (not seat.name and seat.peer_url == offer.peer_url):
            return offer
    return None


def decide(seats: Sequence[Seat], offers: Sequence[Offer], *, learners: bool, size: int = MEMBERS) -> Action:
    """The next change to the cluster ``seats`` given the live ``offers``."""
    voting = [s for s in seats if not s.learner]
    for seat in seats:
        if host_of(seat, offers) is None:
            if not seat.learner and len(voting) <= 1:
                return Wait(f"member {seat.name or seat.id:} has no live host, but it is the last voting member")
            return Remove(seat.id, f"member {seat.name or format(seat.id, 'x')}'s host is gone")
    pending = [s for s in seats if not s.started]
    if pending:
        return Wait(f"member {pending[0].peer_url} added, not started yet")
    learning = [s for s in seats if s.learner]
    if learning:
        return Promote(learning[0].id, learning[0].name)
    if len(voting) >= size:
        return Wait(f"{len(voting)} members")
    held = {host_of(s, offers).addr for s in seats}
    free = sorted((o for o in offers if o.addr not in held), key=lambda o: (o.order, o.host_id))
    if not free:
        return Wait(f"{len(voting)} member(s), no other host to hold one")
    return Add(free[0], learner=learners)


def initial_cluster(seats: Sequence[Seat], new: Offer) -> str:
    """``--initial-cluster`` for ``new`` joining ``seats``: every started member and itself."""
    known = [f"{s.name}={s.peer_url}" for s in seats if s.started and s.name != new.host_id]
    return ",".join([*known, f"{new.host_id}={new.peer_url}"])


def _url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr
