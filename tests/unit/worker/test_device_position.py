"""A worker's device through rounds (torch.cuda faked): its slot, never the plan's order.

The review's T7 for F1: on a host of four, w0 is lost; the survivors' positions in the
plan shift, their devices must not.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from elastic.contract.devices import capability
from elastic.contract.errors import ElasticError
from elastic.contract.events import EventLog
from elastic.contract.worker_config import WorkerConfig
from elastic.worker.ring_entry import RingEntry
from elastic.rendezvous import RoundPlan
from elastic.rendezvous.rounds import Slot


def _plan(round_number, workers):
    return RoundPlan(round=round_number, slots=tuple(Slot("m", w) for w in workers), hosts={"m": ("h", "127.0.0.1")},
                     store_addr="127.0.0.1:1", created=time.time())


@pytest.fixture
def fake_cuda(monkeypatch):
    device = {"current": 0, "set": []}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device["current"])

    def set_device(index):
        device["set"].append(index)
        device["current"] = index

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    saved = dict(os.environ)  # _take_position sets torchrun's variables
    yield device
    os.environ.clear()
    os.environ.update(saved)


def _entry(backend, slot):
    config = WorkerConfig(job_id="j", endpoints="127.0.0.1:1", worker_id="m.w2", member_id="m", host_id="h",
                          round=1, backend=backend, device_slot=slot)
    # The slot the session pinned, with set_device, before any group.
    return RingEntry(config, None, None, EventLog(None, host="h"), None, capability(backend), local_rank=slot)


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", "gloo"])
def test_a_survivor_keeps_its_slot_when_the_plan_order_shifts(fake_cuda, backend):
    fake_cuda["current"] = 2
    entry = _entry(backend, 2)
    at = entry._take_position(_plan(1, ["m.w0", "m.w1", "m.w2", "m.w3"]))
    assert (at.rank, at.local_rank, os.environ["LOCAL_RANK"]) == (2, 2, "2")
    # w0 lost: w2 is now second of its host in the plan, and third once w4 joins.
    at = entry._take_position(_plan(2, ["m.w1", "m.w2", "m.w3"]))
    assert (at.rank, at.local_rank, at.local_world_size) == (1, 2, 3)
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("2", "3")
    at = entry._take_position(_plan(3, ["m.w1", "m.w2", "m.w3", "m.w4"]))
    assert (at.rank, at.local_rank, os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == (1, 2, "2", "4")
    assert entry.position == at  # what elastic.rank() and hvd.rank() answer with
    assert fake_cuda["set"] == []  # no round sets the device: the session did, once
    assert fake_cuda["current"] == 2


def test_a_worker_whose_device_moved_raises_instead_of_driving_two_gpus(fake_cuda):
    fake_cuda["current"] = 0  # something moved it off its slot
    entry = _entry("nccl", 2)
    with pytest.raises(ElasticError, match="would move from cuda:2 to cuda:0"):
        entry._take_position(_plan(2, ["m.w1", "m.w2"]))
