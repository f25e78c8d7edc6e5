"""The torchrun-style store per round: served and waited for only while the job's workers
may be torchrun-style scripts (plain_store.py), on an in-memory etcd."""

from __future__ import annotations

import threading

import pytest

from elastic.agent.plain_store import PlainStores
from elastic.rendezvous import JobKeys, RoundPlan, Slot
from elastic.rendezvous.errors import RendezvousTimeoutError
from tests.fakes.kv import MemoryKv

pytestmark = pytest.mark.timeout(30)
KEYS = JobKeys("j")


def _plan(number: int) -> RoundPlan:
    return RoundPlan(round=number, slots=(Slot("a", "a.w0"), Slot("b", "b.w0")),
                     hosts={"a": ("a", "127.0.0.1"), "b": ("b", "127.0.0.1")}, store_addr="127.0.0.1:1", created=0.0)


def test_until_the_job_is_known_elastic_rank0_serves_and_the_others_wait():
    kv = MemoryKv()
    rank0, other = PlainStores(kv, KEYS, "a", "127.0.0.1"), PlainStores(kv, KEYS, "b", "127.0.0.1")
    try:
        with pytest.raises(RendezvousTimeoutError):
            other.address(_plan(1), timeout=0.05)  # nobody served it yet
        rank0.serve_if_rank0(_plan(1))
        assert other.address(_plan(1), timeout=1.0)[0] == "127.0.0.1"
    finally:
        rank0.close()


def test_once_an_agent_says_its_workers_are_elastic_nobody_waits_a_joiner_included():
    kv = MemoryKv()
    rank0, joiner = PlainStores(kv, KEYS, "a", "127.0.0.1"), PlainStores(kv, KEYS, "b", "127.0.0.1")
    said = []
    rank0.say_elastic(lambda what, op: (said.append(what), op()))
    rank0.say_elastic(lambda what, op: (said.append(what), op()))  # once
    assert said == ["say the job's workers are elastic"] and rank0.job_is_elastic()
    assert joiner.job_is_elastic() and joiner.address(_plan(2), timeout=0.05) is None  # no wait


def test_a_joiner_waiting_for_a_store_stops_when_the_job_is_said_elastic():
    kv = MemoryKv()
    rank0, joiner = PlainStores(kv, KEYS, "a", "127.0.0.1"), PlainStores(kv, KEYS, "b", "127.0.0.1")
    answer = []
    waiting = threading.Thread(target=lambda: answer.append(joiner.address(_plan(3), timeout=10.0)))
    waiting.start()
    rank0.say_elastic(lambda what, op: op())
    waiting.join(5.0)
    assert answer == [None]
