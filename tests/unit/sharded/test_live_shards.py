"""LiveShards and slot reuse: a commit finds the live shards once per layout, copies them in
one call, and notices every change that would make it read the wrong tensors.

A real FSDP2 module over a world of one (gloo, in this process): the DTensors, their local
tensors and FSDP2's lazy init are torch's own, not fakes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from elastic.sharded import modules
from elastic.sharded.live_shards import LiveShards, live_shards
from elastic.sharded.slots import ShardSlot, slot_for
from elastic.worker.sync_plan import CommitId


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sharded_model(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    modules.default_shard(model, mesh)
    return model


def train_step(model, optimizer):
    model(torch.randn(4, 5)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_step_in_place_keeps_the_live_shards_and_the_copy_reads_the_new_values(mesh):
    model = sharded_model(mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    live = live_shards(None, model, optimizer)
    assert [k for k in live.tensors if k.startswith("optim.")] == [
        f"optim.{fqn}.{name}" for fqn, _ in model.named_parameters() for name in ("exp_avg", "exp_avg_sq")]
    train_step(model, optimizer)  # updates every tensor in place
    assert live_shards(live, model, optimizer) is live
    slot = ShardSlot(live.layout, 1, 0)
    slot.copy_from(live)
    for key, tensor in live.tensors.items():
        assert torch.equal(slot.view(key), modules.local(tensor).reshape(-1)), key
    train_step(model, optimizer)
    slot.copy_from(live)  # the cached views: still the slot's own buffers, new values
    for key, tensor in live.tensors.items():
        assert torch.equal(slot.view(key), modules.local(tensor).reshape(-1)), key


@pytest.mark.parametrize("change", ["first optimizer step", "new storage", "other model", "other optimizer"])
def test_every_change_of_what_a_commit_reads_makes_new_live_shards(mesh, change):
    model = sharded_model(mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 5))  # FSDP2's lazy init before the first look, as in training
    if change != "first optimizer step":
        train_step(model, optimizer)
    live = live_shards(None, model, optimizer)
    if change == "first optimizer step":  # Adam creates its state at its first step
        train_step(model, optimizer)
    elif change == "new storage":
        weight = next(model.parameters())
        local = weight._local_tensor
        weight._local_tensor = local.clone()  # what a re-initialisation of FSDP2's storage does
    elif change == "other model":
        model = sharded_model(mesh)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    again = live_shards(live, model, optimizer)
    assert again is not live
    assert isinstance(again, LiveShards) and again.current(model, optimizer)


def test_a_slot_is_reused_while_its_layout_fits_and_forgets_its_commit():
    layout = modules.layout_of({"model.w": torch.zeros(6, 2), "model.b": torch.zeros(6)})
    slot = ShardSlot(layout, 4, 1)
    slot.commit = CommitId(2, 9)
    same = slot_for(slot, layout, 4, 1)
    assert same is slot and same.commit is None
    other_world = slot_for(same, layout, 3, 1)
    assert other_world is not same and other_world.world == 3
    # Six rows over 4 ranks: shards 1 and 2 have two rows each, shard 3 none.
    other_shard = slot_for(same, layout, 4, 2)
    assert other_shard is not same and other_shard.flat["float32"] is same.flat["float32"]
    empty_shard = slot_for(same, layout, 4, 3)
    assert empty_shard.nbytes == 0 and empty_shard.flat["float32"] is not same.flat["float32"]


def test_releasing_a_model_frees_its_shards_grads_and_optimizer_state_even_while_referenced(mesh):
    from elastic.sharded.live_shards import free_storage

    model = sharded_model(mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    model(torch.randn(4, 5)).sum().backward()  # grads present too
    live = live_shards(None, model, optimizer)
    expected = sum(t.untyped_storage().nbytes() for t in live.sources)
    freed = free_storage(model, optimizer)
    assert freed >= expected > 0
    assert all(t.untyped_storage().nbytes() == 0 for t in live.sources)  # the references remain, the memory not
    assert all(p.grad._local_tensor.untyped_storage().nbytes() == 0 for p in model.parameters())
