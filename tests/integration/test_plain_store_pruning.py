"""A job that re-forms hundreds of times must not keep hundreds of rounds of keys:
the agent's round store (``/round/<n>/...``, pruned by ``prune_round_keys``) and the
etcd addresses of the fresh stores for torchrun-style scripts (``plainstores/<n>``,
written and pruned by ``PlainStores``). The agent's own store server, torch's client
writing the keys as a round's workers do, real etcd."""

from __future__ import annotations

import datetime
import os
import socket
import struct

import pytest
import torch.distributed as dist

from elastic.agent.plain_store import PlainStores, prune_round_keys
from elastic.agent.store_wire import VALIDATION_MAGIC, Query, request
from elastic.rendezvous import JobKeys, RoundPlan
from elastic.rendezvous.rounds import Slot
from tests.fakes.store_process import StoreProcess

pytestmark = pytest.mark.timeout(240)

ROUNDS = 200  # cheap rounds: keys only
SERVED_ROUNDS = 60  # each one a store server


def _round_numbers(keys: list[str]) -> set[int]:
    """The rounds that keys of the form /round/<n>/... belong to."""
    return {int(key.split("/")[2]) for key in keys if key.startswith("/round/")}


class _AgentView:
    """The agent's in-process view of its store (list_keys, delete_key), here across
    the pipe of the server's process (tests/fakes/store_process.py says why)."""

    def __init__(self, server: StoreProcess):
        self._server = server

    def list_keys(self) -> list[str]:
        return self._server.keys()

    def delete_key(self, key: str) -> bool:
        return self._server.ask(f"delete {key}") == "True"


def test_an_agents_round_store_keeps_only_the_current_and_previous_rounds_keys():
    server = StoreProcess()
    try:
        store = _AgentView(server)
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=10))
        client.set("job/not-a-round", "stays")  # keys outside /round/ are not the pruner's
        for number in range(1, ROUNDS + 1):
            prune_round_keys(store, number)  # the agent, on the new plan (agent._follow_control)
            # The round's workers, as a worker's RingEntry does: a PrefixStore per round, with the
            # process group's own keys under a further prefix.
            round_store = dist.PrefixStore(f"/round/{number}/", client)
            round_store.set("joined/0", "x")
            dist.PrefixStore("pg/", round_store).set("rank_0", "addr")
            client.num_keys()  # an answer: the sets before it are done
            assert _round_numbers(store.list_keys()) <= {number - 1, number}, number
        keys = store.list_keys()
        assert _round_numbers(keys) == {ROUNDS - 1, ROUNDS}
        assert len(keys) == 2 * 2 + 1, keys
        assert client.get("job/not-a-round") == b"stays"
    finally:
        server.stop()


def _reachable(port: int) -> bool:
    """A client's handshake (VALIDATE, PING) is answered: the store serves."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request(Query.VALIDATE, VALIDATION_MAGIC) + request(Query.PING, 7))
        return sock.recv(4) == struct.pack("=I", 7)


def _plan(number: int, rank0: str, other: str) -> RoundPlan:
    slots = (Slot(rank0, f"{rank0}.w0"), Slot(other, f"{other}.w0"))
    return RoundPlan(round=number, slots=slots, hosts={}, store_addr="", created=0.0)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_plain_store_addresses_and_stores_stay_bounded_while_rank_0_moves_between_hosts(etcd, job_prefix):
    keys = JobKeys(job_prefix.rstrip("/").rsplit("/", 1)[1])
    assert keys.prefix == job_prefix
    agents = {m: PlainStores(etcd, keys, m, "127.0.0.1") for m in ("host-a", "host-b")}
    baseline = None
    for number in range(1, SERVED_ROUNDS + 1):
        # Rank 0 moves between the hosts every few rounds (a lost rank 0, a new joiner
        # ahead in the order), so a host can stop serving with its last rounds published.
        rank0, other = ("host-a", "host-b") if (number // 7) % 2 == 0 else ("host-b", "host-a")
        plan = _plan(number, rank0, other)
        for agent in agents.values():  # every agent acts on every plan (agent._follow_rounds)
            agent.serve_if_rank0(plan)
        host, port = agents[other].address(plan, timeout=10)  # what a worker of the round is given
        assert _reachable(port), number
        kvs, _ = etcd.get_prefix(job_prefix + "plainstores/")
        assert [kv.key for kv in kvs] == [keys.plain_store(n) for n in (number - 1, number) if n > 0], number
        if number == 20:
            baseline = (_open_fds(), _threads())
    # Old stores were closed, not only forgotten: 40 rounds later the process holds
    # no more sockets or threads than it did (each agent keeps its two newest stores).
    fds, threads = _open_fds(), _threads()
    assert fds <= baseline[0] + 4 and threads <= baseline[1] + 2, (baseline, fds, threads)
    for agent in agents.values():
        agent.close()
