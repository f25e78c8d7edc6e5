"""Is that agent alive? One probe, what each answer proves, and the one place a member's lease is revoked.

A member's keys live on its lease, which outlives a dead agent by up to the TTL.
Waiting that long is right when we cannot tell a dead host from one we merely
cannot reach (a partition may be on *our* side). But a TCP connect to the agent's
port (the store it serves for as long as it lives) says more than nothing:

    ACCEPTED  the agent listens: alive, and reachable from here
    REFUSED   the host answered and nothing listens there (a TCP reset): the agent
              process is gone, its workers died with it (parent-death signal) and
              nobody will ever refresh its lease. Proof of death; the host is reachable
    SILENT    no answer within the timeout, no route, any other error: no proof either
              way (a partition may be ours), and unreachable from here

``probe`` asks many agents at once (non-blocking connects, one timeout for all). Each
decision that rests on it has one owner, and asks it here:

* a member whose agent is dead (``proves_dead``): the coordinator revokes its lease when
  a ring broke and nobody said why (``rounds.ProbeLiveness``, ``coordinator.py``), so the
  round forms in about a second instead of a TTL;
* a coordinator whose agent is dead: the agents whose ring broke, and only they
  (``succession.py``), so another agent leads at once;
* a peer that cannot be reached (not ``reachable``): the agents' peer probe while a ring
  stalls, reported to etcd for the coordinator to decide on (``elastic/agent/peer_probe.py``,
  ``reachability.py``).

Every revocation of a member's lease goes through ``revoke_member``.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import time
from enum import Enum
from typing import Hashable, Iterable, Mapping, Optional, TypeVar

from .errors import MalformedValueError, RendezvousError
from .keys import JobKeys
from .kv import Kv
from .rounds import Member

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.5  # the coordinator's and the succession's: a live agent on a loaded host answers in ms


class Answer(Enum):
    ACCEPTED = "accepted"
    REFUSED = "refused"
    SILENT = "silent"


ACCEPTED, REFUSED, SILENT = Answer.ACCEPTED, Answer.REFUSED, Answer.SILENT


def proves_dead(answer: Answer) -> bool:
    """Only a refusal proves that the agent is gone."""
    return answer is REFUSED


def reachable(answer: Answer) -> bool:
    """Any answer, an accept or a refusal, shows the host reachable from here."""
    return answer is not SILENT


_CONNECTED = (0, errno.EISCONN)
K = TypeVar("K", bound=Hashable)


def probe(addresses: Mapping[K, tuple[str, int]], timeout: float = PROBE_TIMEOUT_S,
          resend_every: Optional[float] = None, took: Optional[dict] = None) -> dict[K, Answer]:
    """Connect to every (host, port) of ``addresses`` at once; each one's ``Answer``
    within ``timeout`` seconds (those still waiting then are SILENT).

    With ``resend_every``, another connect (a fresh SYN) goes to those not yet heard
    every so often until the timeout, and an answer to any of them counts: a lost SYN
    or one queued behind a busy link is not silence, where a peer that answers none
    of them for the whole timeout is. ``took``, if given, gets the seconds from the
    first connect to the answer of each peer that answered."""
    heard: dict[K, Answer] = {}  # accepted or refused: a definite answer
    pending: dict[socket.socket, K] = {}
    selector = selectors.DefaultSelector()
    started = time.monotonic()
    deadline = started + timeout
    sends = [started]
    while resend_every and sends[-1] + resend_every < deadline:
        sends.append(sends[-1] + resend_every)

    def hear(key, code: int) -> None:  # a connect of ``key`` ended with ``code``
        if _answer(code) is not SILENT and key not in heard:
            heard[key] = _answer(code)
            if took is not None:
                took[key] = time.monotonic() - started

    try:
        while True:
            now = time.monotonic()
            while sends and sends[0] <= now:
                sends.pop(0)
                for key, address in addresses.items():
                    if key not in heard and (code := _connect(key, address, pending, selector)) is not None:
                        hear(key, code)
            if len(heard) == len(addresses):
                break
            # Once more at the deadline, without waiting: a prober that was not scheduled
            # (a starved host, a busy GIL) must not take its own lateness for the peer's
            # silence; the kernel has the answers that came meanwhile.
            left = max(0.0, min(deadline, sends[0] if sends else deadline) - time.monotonic())
            for selected, _ in selector.select(left):
                sock = selected.fileobj
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                selector.unregister(sock)
                hear(pending.pop(sock), code)
                sock.close()
            if time.monotonic() >= deadline and (left == 0.0 or not pending):
                break
    finally:
        for sock in pending:
            sock.close()
        selector.close()
    return {key: heard.get(key, SILENT) for key in addresses}


def _connect(key, address: tuple[str, int], pending: dict, selector) -> Optional[int]:
    """One non-blocking connect to ``address``: pending (None), or its code at once."""
    host, port = address
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return errno.EHOSTUNREACH
    sock.setblocking(False)
    try:
        code = sock.connect_ex((host, port))
    except OSError:  # a name that does not resolve: no answer
        code = errno.EHOSTUNREACH
    if code in (errno.EINPROGRESS, errno.EAGAIN):
        pending[sock] = key
        selector.register(sock, selectors.EVENT_WRITE)
        return None
    sock.close()
    return code


def _answer(code: int) -> Answer:
    if code in _CONNECTED:
        return ACCEPTED
    return REFUSED if code == errno.ECONNREFUSED else SILENT  # no route, network down: no answer


def answer_of(addr: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> Answer:
    """One agent's answer (``probe`` of one address)."""
    return probe({0: (addr, port)}, timeout)[0]


def read_member(etcd: Kv, keys: JobKeys, member_id: str,
                retry_deadline: Optional[float] = None) -> Optional[tuple[Member, int]]:
    """A member's record and the lease it lives on; None when it is gone, or unreadable
    (no address to prove anything with: its lease decides)."""
    kv = etcd.get(keys.member(member_id), retry_deadline=retry_deadline)
    if kv is None:
        return None
    try:
        return Member.from_json(kv.value), kv.lease
    except MalformedValueError:
        return None


def revoke_member(etcd: Kv, member: Member, lease: int, why: str, retry_deadline: Optional[float] = None,
                  evidence: str = "refuses connections") -> bool:
    """Revoke ``member``'s lease (its member record, and the election key if it led, go
    with it); True once done. The one place a member's lease is revoked."""
    try:
        etcd.revoke_lease(lease, retry_deadline=retry_deadline)
    except RendezvousError as exc:  # already revoked or expired: gone either way, not by us
        log.info("could not evict member %s: %s", member.member_id, exc)
        return False
    log.warning("member %s (%s): its agent at %s:%d %s; evicted it without waiting for its TTL (%s)",
                member.member_id, member.host, member.addr, member.store_port, evidence, why)
    return True


def evict_dead_members(etcd: Kv, keys: JobKeys, member_ids: Iterable[str],
                       timeout: float = PROBE_TIMEOUT_S) -> list[str]:
    """Probe several members at once; revoke the leases of those proven dead."""
    records = {m: r for m in dict.fromkeys(member_ids) if (r := read_member(etcd, keys, m)) is not None}
    answers = probe({m: (member.addr, member.store_port) for m, (member, _) in records.items()}, timeout)
    return [m for m, answer in answers.items()
            if proves_dead(answer) and revoke_member(etcd, *records[m], "a ring broke and nobody said why")]
