"""A refill: a replica group's workers take their coordinates' slots from the healthy replicas.

When the ring's groups have the shape of the commit's, every training worker needs the
slot of its coordinate: its own, which it copies into its new model, or (a refilled
group, a spare's stale one) a healthy replica's, which ``hybrid_plan.plan_refill`` cuts
into one stripe per holder. The pieces are posted first (``post_refill``) and travel
while the commit's meta is broadcast and the model is built; ``finish_refill`` waits for
them and copies the slot into the model's shards. The received slot is the commit in the
new ring's layout already: the state keeps it as its own.

Slots of a hybrid commit are laid out as the local tensors (``group_slot``): without
tensor parallelism that is FSDP2's dim-0 shard ``coordinate`` of ``shard_size``, so the
1-D path (``reshard_plan.plan_reshard``) re-shards from them unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..contract.errors import ElasticError
from ..worker.sync_plan import CommitId
from . import modules
from .hybrid_plan import MeshPlan, plan_refill
from .reshard_plan import TensorLayout
from .slots import ShardSlot, torch_dtype

_SLOT_TAG = 1 << 26  # a refill's messages, per (holder, receiver) pair from here


def group_slot(previous: Optional[ShardSlot], local: tuple[TensorLayout, ...], world: int,
               coordinate: int) -> ShardSlot:
    """A slot for coordinate ``coordinate`` of a group of ``world`` workers, laid out as the
    local tensors (``local``: their shapes). Without tensor parallelism that is exactly
    FSDP2's dim-0 shard ``coordinate`` of ``world``, so the 1-D path re-shards from it."""
    if previous is not None and previous.layout == local and (previous.world, previous.shard) == (world, coordinate):
        previous.commit = None
        return previous
    slot = ShardSlot(local, 1, 0, reuse=previous)
    slot.world, slot.shard = world, coordinate
    return slot


def local_layout(keys, tensors: dict) -> tuple[TensorLayout, ...]:
    """The layout of ``tensors``' local parts (``keys``: the commit's tensors, in order)."""
    out = []
    for key in keys:
        local = modules.local(tensors[key])
        out.append(TensorLayout(key, tuple(local.shape), str(local.dtype).replace("torch.", "")))
    return tuple(out)


def post_refill(rank: int, plan: MeshPlan, reports: list[dict], chosen, holders: dict, sources: dict):
    """Same group shape as the commit's: every training worker takes the slot of its
    coordinate, its own (a local copy, later) or a healthy replica's (``plan_refill``),
    received into buffers of the slot's sizes: posted now, finished by ``finish_refill``."""
    sizes = {}
    for rep in reports:
        for r, c, w, s, per_dtype in rep["sizes"]:
            if (CommitId(r, c), w) == chosen:
                sizes[s] = per_dtype
    needs = {member: coordinate for members in plan.groups for coordinate, member in enumerate(members)}
    pieces = plan_refill(needs, holders, sizes)
    staging = None
    if rank in needs and rank not in holders.get(needs[rank], ()):
        staging = {d: torch.empty(n, dtype=torch_dtype(d)) for d, n in sorted(sizes[needs[rank]].items())}
    works, moved, tags = [], 0, {}
    for piece in pieces:
        if rank not in (piece.holder, piece.receiver):
            continue
        pair = (piece.holder, piece.receiver)
        tags[pair] = tag = tags.get(pair, -1) + 1
        if piece.holder == rank:
            buffer = sources[piece.coordinate].flat[piece.dtype].narrow(0, piece.start, piece.length)
            works.append(dist.isend(buffer, dst=piece.receiver, tag=_SLOT_TAG + tag))
        else:
            buffer = staging[piece.dtype].narrow(0, piece.start, piece.length)
            works.append(dist.irecv(buffer, src=piece.holder, tag=_SLOT_TAG + tag))
            moved += buffer.numel() * buffer.element_size()
    return works, moved, needs.get(rank), staging


def finish_refill(refill, meta, chosen, sources: dict, targets: dict):
    """Wait for the refill's pieces; copy this worker's slot into its new model's shards.
    Returns the bytes received and the slot they came in (None if it held its own)."""
    works, moved, coordinate, staging = refill
    for work in works:
        work.wait()
    if coordinate is None:  # a spare: it only sent
        return moved, None
    received = None
    if staging is not None:
        holder = ShardSlot((), 1, 0)
        holder.flat = staging
        local = local_layout([t.key for t in meta.layout], targets)
        received = group_slot(holder, local, chosen[1], coordinate)
        if received.flat is not staging:
            raise ElasticError(f"the model built here does not match commit {chosen[0].count}'s shard "
                               f"{coordinate}: is model() the same on every worker?")
        received.commit = chosen[0]
    slot = received if received is not None else sources[coordinate]
    with torch.no_grad():
        for key, tensor in targets.items():
            modules.local(tensor).view(-1).copy_(slot.view(key))
    return moved, received
