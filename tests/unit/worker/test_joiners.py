"""Rank 0's look at a pending round's joiners (elastic/worker/joiners.py), against a real TCPStore."""

from __future__ import annotations

import datetime
import logging
import time

import pytest
import torch.distributed as dist

from elastic.worker import joiners
from elastic.worker.joiners import JoinerWatch
from elastic.rendezvous import RoundPlan
from elastic.rendezvous.rounds import Slot


def plan(round_number, workers, store_addr="127.0.0.1:1"):
    return RoundPlan(round=round_number, slots=tuple(Slot(w.split(".")[0], w) for w in workers),
                     hosts={w.split(".")[0]: ("h", "127.0.0.1") for w in workers}, store_addr=store_addr,
                     created=time.time())


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    yield store


CURRENT = plan(1, ["a.w0", "b.w0"])


def test_the_ring_switches_once_every_joiner_arrived(server):
    pending = plan(2, ["a.w0", "b.w0", "c.w0", "d.w0"], f"127.0.0.1:{server.port}")
    watch = JoinerWatch()
    arrivals = dist.PrefixStore("/round/2/", server)
    assert not watch.ready(CURRENT, pending)
    arrivals.add("arrived", 1)
    assert not watch.ready(CURRENT, pending)
    arrivals.add("arrived", 1)
    assert watch.ready(CURRENT, pending)


def test_a_round_without_joiners_is_ready_without_asking_its_store():
    def connect(host, port):
        raise AssertionError("no store needed")

    assert JoinerWatch(connect=connect).ready(CURRENT, plan(2, ["a.w0"]))


def test_a_store_that_does_not_answer_is_asked_again_a_second_later():
    clock, tries = Clock(), []

    def connect(host, port):
        tries.append(clock.now)
        raise RuntimeError("connection refused")

    watch = JoinerWatch(clock=clock, connect=connect)
    pending = plan(2, ["a.w0", "b.w0", "c.w0"])
    assert not watch.ready(CURRENT, pending)
    clock.now += joiners.RETRY_S / 2
    assert not watch.ready(CURRENT, pending)  # a commit soon after: no second try yet
    clock.now += joiners.RETRY_S
    assert not watch.ready(CURRENT, pending)
    assert tries == [100.0, 100.0 + 1.5 * joiners.RETRY_S]


def test_joiners_that_never_arrive_are_reported_at_30_then_60_seconds(server, caplog):
    clock = Clock()
    pending = plan(2, ["a.w0", "b.w0", "c.w0"], f"127.0.0.1:{server.port}")
    watch = JoinerWatch(clock=clock)
    caplog.set_level(logging.WARNING, logger="elastic.worker.joiners")
    for seconds in (0, 20, 31, 45, 61):
        clock.now = 100.0 + seconds
        assert not watch.ready(CURRENT, pending)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("round 2: 0 of 1 joining worker(s) arrived within 31s (c.w0)")
    assert "trains on at world 2" in lines[0]
    assert "within 61s" in lines[1]
