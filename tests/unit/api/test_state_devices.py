"""Tensors keep their device through a rollback, a sync and a durable resume, and the
CUDA generator rolls back with the commit. On the CPU, the "meta" device
stands in for a CUDA device: the rules follow the live tensor's device, or the device
kind the commit recorded."""

from __future__ import annotations


import pytest
import torch

from elastic.checkpoint import Snapshot
from elastic.checkpoint import tree_copy
from elastic.checkpoint import copy_into
from elastic.state import State




def test_a_value_of_the_same_shape_is_overwritten_in_place(ring):
    state = State(ema=torch.zeros(3))
    live = state.ema
    state.commit()
    state.ema.add_(1.0)
    state.restore()
    assert state.ema is live and torch.equal(live, torch.zeros(3))


def test_a_value_of_another_shape_follows_the_live_tensors_device():
    saved = {"values": {"ema": torch.ones(2)}}
    live = torch.empty(5, device="meta")
    placed = copy_into(saved["values"]["ema"], live, ("values", "ema"))
    assert placed.device.type == "meta" and placed.shape == (2,)


def test_a_value_without_a_live_tensor_goes_to_the_recorded_device(monkeypatch):
    monkeypatch.setattr(tree_copy, "_cuda_device", lambda: torch.device("meta"))
    saved = {"scaler": torch.ones(1), "history": [torch.ones(2), 3]}
    cuda = frozenset({("values", "s", "scaler"), ("values", "s", "history", 0)})
    placed = copy_into(saved, None, ("values", "s"), cuda)
    assert placed["scaler"].device.type == "meta" and placed["history"][0].device.type == "meta"
    assert placed["history"][1] == 3
    assert copy_into(torch.ones(1), None, ("values", "x"), cuda).device.type == "cpu"  # not recorded


def test_the_snapshot_names_the_paths_captured_from_cuda():
    snapshot = Snapshot()
    snapshot.capture({"values": {"a": torch.ones(1)}})
    assert snapshot.cuda_paths() == frozenset()


def test_the_cuda_generator_rolls_back_with_the_commit(ring, monkeypatch):
    generator = {"state": torch.tensor([1], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: generator["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda value, *a: generator.update(state=value.clone()))
    state = State(step=0)
    state.commit()
    generator["state"] = torch.tensor([9], dtype=torch.uint8)  # dropout drew numbers since
    cpu_before = torch.get_rng_state()
    torch.rand(3)
    state.restore()
    assert generator["state"].tolist() == [1]
    assert torch.equal(torch.get_rng_state(), cpu_before)
