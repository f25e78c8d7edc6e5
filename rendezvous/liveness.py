"""Proof of death: is a member's agent gone for sure, so its lease can go now?

A member's keys live on its lease, which outlives a dead agent by up to the TTL.
Waiting that long is right when we cannot tell a dead host from one we merely
cannot reach (a partition may be on *our* side). But when the host answers and
says nothing listens on the agent's port any more (a TCP reset: connection
refused), the agent process is gone: its workers died with it (parent-death
signal) and nobody will ever refresh the lease. Revoking the lease then removes
the member (and the election key, if it led) at once, and the rounds move on
in about a second instead of a TTL.

Only a refusal counts. A timeout, an unreachable network or any other error is
no evidence, so those members are left to their TTL.
"""

from __future__ import annotations

import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from .errors import MalformedValueError, RendezvousError
from .keys import JobKeys
from .kv import KeyValue, Kv
from .rounds import Member

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.5
_MAX_PARALLEL_PROBES = 32


ACCEPTED, REFUSED, SILENT = "accepted", "refused", "silent"  # a connect's answers


def agent_answer(addr: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> str:
    """ACCEPTED (the agent listens), REFUSED (the host is up, the agent gone) or SILENT
    (a timeout, an unreachable network, any other error: no proof either way)."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return ACCEPTED
    except ConnectionRefusedError:
        return REFUSED
    except OSError:
        return SILENT


def agent_refuses(addr: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True only when the host refused a connection to the agent's port."""
    return agent_answer(addr, port, timeout) == REFUSED


def evict_if_dead(etcd: Kv, keys: JobKeys, member_id: str) -> bool:
    """Revoke ``member_id``'s lease if its agent refuses connections; True if revoked."""
    kv = etcd.get(keys.member(member_id))
    if kv is None:
        return False
    return _evict(etcd, kv)


def evict_dead_members(etcd: Kv, keys: JobKeys, member_ids: Iterable[str]) -> list[str]:
    """Probe several members in parallel; revoke the leases of the dead ones."""
    wanted = list(dict.fromkeys(member_ids))
    if not wanted:
        return []
    kvs = [kv for kv in (etcd.get(keys.member(m)) for m in wanted) if kv is not None]
    with ThreadPoolExecutor(max_workers=min(_MAX_PARALLEL_PROBES, len(kvs) or 1)) as pool:
        verdicts = list(pool.map(_probe, kvs))
    evicted = []
    for kv, dead in zip(kvs, verdicts):
        if dead and _revoke(etcd, kv):
            evicted.append(Member.from_json(kv.value).member_id)
    return evicted


def _probe(kv: KeyValue) -> bool:
    try:
        member = Member.from_json(kv.value)
    except MalformedValueError:
        return False  # no address to prove anything with: its lease decides
    return agent_refuses(member.addr, member.store_port)


def _evict(etcd: Kv, kv: KeyValue) -> bool:
    return _probe(kv) and _revoke(etcd, kv)


def _revoke(etcd: Kv, kv: KeyValue) -> bool:
    member = Member.from_json(kv.value)
    try:
        etcd.revoke_lease(kv.lease)
    except RendezvousError as exc:
        log.info("could not evict dead member %s: %s", member.member_id, exc)
        return False
    log.warning("member %s (%s): its agent at %s:%d refuses connections; evicted it without waiting for its TTL",
                member.member_id, member.host, member.addr, member.store_port)
    return True
