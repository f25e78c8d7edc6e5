"""gpu review 3, N10: a sharded commit's host copies. The small device tensors of a commit's
meta (module buffers, Adam's per-parameter ``step`` with fused/capturable) travel to the
host in one transfer per device, equal to one copy each; slots that copy from CUDA are
page-locked once and wait once per commit. On this CPU-only machine: the grouping and
splitting on host tensors, and the CPU path as it was."""

from __future__ import annotations

import gc
import logging

import torch

from elastic.sharded import modules, slots
from elastic.sharded.slots import ShardSlot, slot_for
from elastic.worker.sync_plan import CommitId


def mixed_tensors():
    return [
        torch.tensor(7.0),  # Adam's step: 0-d
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
        torch.tensor([True, False, True]),  # 3 bytes: the next piece starts at an odd offset
        torch.randn(4, 5, dtype=torch.float64).t(),  # not contiguous
        torch.randn(3, dtype=torch.bfloat16),
        torch.empty(0, 4),
        torch.randn(2, 2, requires_grad=True),
        torch.tensor([1 + 2j], dtype=torch.complex64),
    ]


def test_gathered_copies_equal_one_copy_each_and_own_their_storage():
    tensors = mixed_tensors()
    copies = modules.copy_gathered(tensors)
    assert len(copies) == len(tensors)
    for copy_, tensor in zip(copies, tensors):
        expected = modules._host_copy(tensor)
        assert (copy_.dtype, copy_.shape, copy_.device) == (expected.dtype, expected.shape, expected.device)
        assert torch.equal(copy_, expected)
        assert not copy_.requires_grad
        # a storage of its own, exactly its size: never a view into the joint buffer
        assert copy_.untyped_storage().nbytes() == copy_.numel() * copy_.element_size()
    tensors[1].add_(100)
    assert torch.equal(copies[1], torch.arange(6).reshape(2, 3))
    assert modules.copy_gathered([]) == []


def test_only_small_plain_device_tensors_are_gathered_per_device():
    class Sub(torch.Tensor):
        pass

    meta = torch.device("meta")  # stands in for a CUDA device: any device that is not the host's
    tensors = [
        torch.zeros(3),  # host: nothing to transfer
        torch.zeros(3, device=meta),
        torch.zeros(modules.SMALL_BYTES // 4 + 1, device=meta),  # large: copied alone
        torch.zeros(2, device=meta).as_subclass(Sub),  # a subclass keeps its own .to
        torch.zeros(2, dtype=torch.int64, device=meta),
        torch.zeros(modules.SMALL_BYTES // 4, device=meta),  # exactly the bound
    ]
    assert modules.gathered_groups(tensors) == {meta: [1, 4, 5]}
    assert modules.gathered_groups([torch.zeros(2)]) == {}


def test_host_copies_on_the_host_are_the_copies_they_were():
    tensors = mixed_tensors()
    for copy_, tensor in zip(modules.host_copies(tensors), tensors):
        assert torch.equal(copy_, modules._host_copy(tensor))
        assert copy_.data_ptr() != tensor.data_ptr() or tensor.numel() == 0


def old_describe(model, optimizer, tensors):
    """describe()'s copies as they were made before N10: one per tensor."""
    buffers = {name: modules._host_copy(b) for name, b in model.named_buffers()}
    names = {p: fqn for fqn, p in model.named_parameters()}
    plain_state = {}
    for p, entries in optimizer.state.items():
        plain = {name: (modules._host_copy(v) if isinstance(v, torch.Tensor) else v)
                 for name, v in entries.items() if f"optim.{names[p]}.{name}" not in tensors}
        if plain:
            plain_state[names[p]] = plain
    return buffers, plain_state


def test_describe_carries_the_same_buffers_and_optimizer_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(5, 3)).square().mean().backward()
        optimizer.step()
    # one state sharded: it stays out of the meta
    tensors = {"optim.0.weight.exp_avg": optimizer.state[model[0].weight]["exp_avg"]}
    meta = modules.describe(CommitId(1, 2), 1, model, optimizer, tensors, {"epoch": 3}, None)
    buffers, plain_state = old_describe(model, optimizer, tensors)
    assert list(meta.buffers) == list(buffers) and list(meta.plain_state) == list(plain_state)
    for name, value in buffers.items():
        assert torch.equal(meta.buffers[name], value)
    for fqn, entries in plain_state.items():
        assert list(meta.plain_state[fqn]) == list(entries)
        for name, value in entries.items():
            assert torch.equal(meta.plain_state[fqn][name], value), (fqn, name)
    assert "exp_avg" not in meta.plain_state["0.weight"] and "exp_avg_sq" in meta.plain_state["0.weight"]
    assert meta.values == {"epoch": 3} and meta.groups[0]["params"] == [n for n, _ in model.named_parameters()]


class Live:
    """A LiveShards stand-in: the commit's tensors and their sources."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.sources = list(tensors.values())


def test_a_copy_from_host_tensors_is_as_it_was(monkeypatch):
    layout = modules.layout_of({"model.w": torch.zeros(4, 2), "model.b": torch.zeros(4)})
    slot = ShardSlot(layout, 1, 0)
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda views, sources, **kw: (calls.append(kw),
                                                                               real(views, sources, **kw)))
    monkeypatch.setattr(slots.host_pinning, "register", lambda buffer: calls.append("register"))
    live = Live({"model.w": torch.randn(4, 2), "model.b": torch.randn(4)})
    slot.copy_from(live)
    assert calls == [{"non_blocking": False}]  # no page-locking, no wait on a device
    assert torch.equal(slot.view("model.w"), live.tensors["model.w"].reshape(-1))
    assert torch.equal(slot.view("model.b"), live.tensors["model.b"])


def test_a_slots_buffers_are_page_locked_once_shared_with_their_reuse_and_unlocked_before_freed(monkeypatch):
    registered, unregistered = [], []
    monkeypatch.setattr(slots.host_pinning, "register", lambda buffer: registered.append(buffer.data_ptr()) or True)

    class Cudart:
        @staticmethod
        def cudaHostUnregister(pointer):
            unregistered.append(pointer)
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart)
    layout = modules.layout_of({"model.w": torch.zeros(6, 2), "model.n": torch.zeros(6, dtype=torch.int64)})
    slot = ShardSlot(layout, 4, 1)
    slot._pins.pin(slot.flat)
    slot._pins.pin(slot.flat)  # once
    assert sorted(registered) == sorted(b.data_ptr() for b in slot.flat.values())
    slot.commit = CommitId(1, 1)
    other = slot_for(slot, layout, 4, 2)  # the same sizes: the buffers, and their locking, go along
    assert other._pins is slot._pins and other._pins.pinned == 2
    pointers = sorted(registered)
    del slot
    gc.collect()
    assert unregistered == []  # still in use by the other slot
    del other
    gc.collect()
    assert sorted(unregistered) == pointers


def test_a_refused_registration_leaves_the_slot_pageable_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(slots.host_pinning, "register", lambda buffer: False)
    monkeypatch.setattr(slots.host_pinning, "refused", lambda: "cudaHostRegister returned 712")
    monkeypatch.setattr(slots, "_pageable_logged", False)
    layout = modules.layout_of({"model.w": torch.zeros(6, 2)})
    with caplog.at_level(logging.DEBUG, logger=slots.__name__):
        for _ in range(2):
            slot = ShardSlot(layout, 1, 0)
            slot._pins.pin(slot.flat)
            assert slot._pins.pinned == 0
    assert caplog.text.count("pageable") == 1 and "712" in caplog.text
