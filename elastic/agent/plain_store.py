"""A fresh TCPStore per round for scripts written for torchrun.

A torchrun script initializes with ``env://``: every rank connects to
MASTER_ADDR:MASTER_PORT and gloo exchanges its addresses under fixed key names.
torch 2.13 no longer prefixes those keys per restart ("a new TCPStore for every
retry"), so re-using one store across rounds hands the restarted workers stale
peer addresses and ``connectFullMesh`` fails. The agent of the round's rank 0
therefore serves a new store for each round and publishes its address in etcd;
every agent reads it before starting a worker of that round.

An elastic worker never uses that store (its rounds have their own, the plan's). Once an
agent has seen one of its workers call ``elastic.init()`` it says so for the job
(``say_elastic``: every worker runs the same script): from then on no agent serves a
plain store, and none waits for one (``address`` returns None), a joining host's agent
included, which has not seen a worker of its own yet.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Callable, Optional

from elastic.rendezvous import Etcd, JobKeys, RoundPlan
from elastic.rendezvous.errors import RendezvousTimeoutError
from elastic.rendezvous.job_lease import put_on_job_lease

from .store_server import StoreServer

log = logging.getLogger(__name__)

_KEEP_ROUNDS = 2  # the current round's store, and the previous one while it drains
_ROUND_NUMBER = re.compile(r"[0-9]{1,12}")  # a round number as the runtime writes it: int() of it is cheap and safe


def round_number(text: str) -> Optional[int]:
    """The round number ``text`` names, or None when it is not one (anyone who reaches a
    store can write a key: 5,000 digits made ``int()`` raise and ended the agent,
    security review 2, H2)."""
    return int(text) if _ROUND_NUMBER.fullmatch(text) else None


class PlainStores:
    def __init__(self, etcd: Etcd, keys: JobKeys, member_id: str, host_addr: str,
                 job_lease: Callable[[], Optional[int]] = lambda: None):
        self._etcd = etcd
        self._keys = keys
        self._member_id = member_id
        self._host_addr = host_addr
        self._job_lease = job_lease
        self._served: dict[int, StoreServer] = {}
        self._elastic = False  # the job's workers are known to be elastic (plainstores/none)
        self._said = False  # we said so

    def serve_if_rank0(self, plan: RoundPlan) -> None:
        """If rank 0 of ``plan`` is ours, start the round's store and publish it."""
        if plan.slots[0].member_id != self._member_id or plan.round in self._served:
            return
        # Published at once: the store serves from the moment its port is bound.
        store = StoreServer(self._host_addr, f"plain-store-{plan.round}")
        self._served[plan.round] = store
        key, address = self._keys.plain_store(plan.round), f"{self._host_addr}:{store.port}".encode()
        put_on_job_lease(self._etcd, key, address, self._job_lease())  # gone with an abandoned job
        for old in sorted(self._served)[:-_KEEP_ROUNDS]:
            self._served.pop(old).close()
        self._prune_addresses(plan.round)

    def _prune_addresses(self, current: int) -> None:
        """Delete the addresses of rounds older than the kept ones, whoever served them.

        Rank 0 moves between hosts (its host lost, a joiner ahead in the order): a host
        that deleted only its own old addresses would leave its last ones behind each
        time it stopped being rank 0, or left the job, for ever. Nobody reads them: an
        agent starts workers only for the newest plan.
        """
        kvs, _ = self._etcd.get_prefix(self._keys.prefix + "plainstores/")
        for kv in kvs:
            number = round_number(kv.key.rsplit("/", 1)[1])
            if number is not None and number <= current - _KEEP_ROUNDS:
                self._etcd.delete(kv.key)

    def job_is_elastic(self) -> bool:
        """Has an agent of the job said that its workers are elastic (``say_elastic``)?"""
        if not self._elastic:
            self._elastic = self._etcd.get(self._keys.no_plain_stores) is not None
        return self._elastic

    def say_elastic(self, write: Callable[[str, Callable[[], object]], None]) -> None:
        """Our workers are elastic, hence every worker of the job: nobody needs a plain
        store. Said once, through ``write`` (the agent's queue while etcd is away)."""
        if not self._said:
            self._said = True
            write("say the job's workers are elastic", self._mark_elastic)

    def _mark_elastic(self) -> None:
        put_on_job_lease(self._etcd, self._keys.no_plain_stores, b"elastic", self._job_lease())
        self._elastic = True

    def address(self, plan: RoundPlan, timeout: float = 30.0) -> Optional[tuple[str, int]]:
        """The round's store address (waits, bounded, for rank 0's agent to publish it);
        None once the job's workers are known to be elastic (no store is served then)."""
        deadline = time.monotonic() + timeout
        delay = 0.005
        said = False
        while True:
            if self.job_is_elastic():
                return None
            kv = self._etcd.get(self._keys.plain_store(plan.round))
            address = parse_address(kv.value) if kv is not None else None
            if address is not None:
                return address
            if kv is not None and not said:
                log.warning("round %d: skipping the malformed store address %r at %s; waiting for a valid one",
                            plan.round, kv.value[:80], kv.key)
                said = True
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(f"round {plan.round}: no store published within {timeout:g}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def close(self) -> None:
        while self._served:
            self._served.popitem()[1].close()


def parse_address(value: bytes) -> Optional[tuple[str, int]]:
    """``host:port`` as a store address, or None when it is not one."""
    try:
        host, port = value.decode("ascii").rsplit(":", 1)
        number = int(port)
    except ValueError:  # not ASCII, no colon, not a number
        return None
    return (host, number) if host and 0 < number < 65536 else None


def prune_round_keys(store, current_round: int) -> None:
    """Delete the keys of rounds before the previous one from an agent's round store
    (``/round/<n>/...``, see worker/ring_entry.py): a job that re-forms a thousand
    times must not keep a thousand rounds of keys. ``store`` is the agent's server
    (its ``list_keys``/``delete_key`` see keys as torch's client lists them); ``None``:
    it is closed, so there is nothing to prune. Housekeeping never ends the agent: a
    failure here is logged and the keys wait for the next round."""
    if store is None:
        return
    try:
        for key in store.list_keys():
            parts = key.split("/", 3)
            number = round_number(parts[2]) if len(parts) > 2 and parts[1] == "round" else None
            if number is not None and number < current_round - 1:
                store.delete_key(key)
    except Exception as exc:  # noqa: BLE001 - pruning is housekeeping: the job goes on without it
        log.error("round %d: pruning the round store failed (%s: %s); the job goes on",
                  current_round, type(exc).__name__, exc)
