"""Moving a re-shard's pieces: each rank's element ranges, from its own copy or its holders'.

``reshard_plan.plan_reshard`` decides who sends which range to whom; this is the moving.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .reshard_plan import Piece
from .slots import ShardSlot


def run_pieces(pieces: list[Piece], rank: int, sources: dict[int, ShardSlot], targets: dict[str, torch.Tensor],
                posted: Callable[[], object] = lambda: None) -> int:
    """Move this rank's pieces: local copies, then every send and receive posted at once.
    Tags count per (holder, receiver) pair in the plan's order, the same on both ends.
    Slots live in host memory and travel over the CPU backend: a piece for a GPU shard
    lands in a host buffer first and is copied to the device once everything arrived."""
    works, moved, counts, to_device = [], 0, {}, []
    with torch.no_grad():
        for piece in pieces:
            if rank not in (piece.holder, piece.receiver):
                continue
            pair = (piece.holder, piece.receiver)
            counts[pair] = tag = counts.get(pair, -1) + 1
            if piece.holder == rank:
                source = sources[piece.shard].view(piece.key).narrow(0, piece.src_start, piece.length)
            if piece.receiver == rank:
                target = targets[piece.key].view(-1).narrow(0, piece.dst_start, piece.length)
            if piece.holder == piece.receiver:
                target.copy_(source)
            elif piece.holder == rank:
                works.append(dist.isend(source, dst=piece.receiver, tag=tag))
            else:
                if target.device.type != "cpu":
                    to_device.append((target, torch.empty(piece.length, dtype=target.dtype)))
                    target = to_device[-1][1]
                works.append(dist.irecv(target, src=piece.holder, tag=tag))
                moved += target.numel() * target.element_size()
        posted()
        for work in works:
            work.wait()
        for target, staged in to_device:
            target.copy_(staged)
    return moved
