"""Which bytes of a sharded commit move from whom to whom when the ring re-forms: pure functions.

FSDP2 shards every parameter (and so every optimizer state of the parameter's shape)
on dim 0 the way ``torch.chunk`` does: over a world of ``W`` each rank owns
``ceil(n / W)`` rows, the last ranks fewer or none (torch's ``_chunk_with_empty``
pads the list of chunks with empty ones). ``shard_rows`` is that rule.

A commit is a set of *shards*: shard ``s`` of a commit made by a ring of ``W`` workers
is what rank ``s`` of that ring held, every sharded tensor's rows ``shard_rows(n, W, s)``.
After a re-formation each rank reports which shards of which commits it holds whole
(its own copy, or a replica it keeps for another rank). ``newest_covered`` picks the
newest commit every shard of which some rank holds; ``plan_reshard`` says which
element ranges of which shard each rank of the new ring takes from which holder:
its own copy when it holds one, else striped across every holder of the range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Sequence


def shard_rows(rows: int, world: int, shard: int) -> tuple[int, int]:
    """[start, end) of the dim-0 rows that rank ``shard`` of ``world`` owns (torch.chunk's rule)."""
    if world < 1 or not 0 <= shard < world:
        raise ValueError(f"shard {shard} of a world of {world}")
    per = -(-rows // world) if rows else 0
    return min(rows, shard * per), min(rows, (shard + 1) * per)


@dataclass(frozen=True)
class TensorLayout:
    """One sharded tensor of a commit: its name, global shape and dtype (a string)."""

    key: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_elements(self) -> int:
        size = 1
        for dim in self.shape[1:]:
            size *= dim
        return size

    def shard_elements(self, world: int, shard: int) -> int:
        start, end = shard_rows(self.rows, world, shard)
        return (end - start) * self.row_elements


@dataclass(frozen=True)
class Piece:
    """``length`` elements of tensor ``key``: from element ``src_start`` of old shard
    ``shard`` (held by ``holder``) to element ``dst_start`` of ``receiver``'s new shard."""

    key: str
    shard: int
    holder: int
    receiver: int
    src_start: int
    dst_start: int
    length: int


def newest_covered(held: Mapping[int, Sequence[tuple[Hashable, int]]],
                   worlds: Mapping[Hashable, int]) -> Optional[Hashable]:
    """The newest commit each of whose ``worlds[c]`` shards some rank holds, or None.

    ``held``: rank -> the (commit, shard) pairs it holds whole. A commit is any sortable
    key: the state uses (CommitId, world), as one commit may be held in the layouts of
    two rings while a re-shard is being made safe."""
    holders: dict[tuple, set[int]] = {}
    for rank, pairs in held.items():
        for commit, shard in pairs:
            holders.setdefault((commit, shard), set()).add(rank)
    for commit in sorted(worlds, reverse=True):
        if all((commit, s) in holders for s in range(worlds[commit])):
            return commit
    return None


def plan_reshard(layout: Sequence[TensorLayout], old_world: int, holders: Mapping[int, Sequence[int]],
                 new_world: int, receivers: Optional[Sequence[int]] = None) -> list[Piece]:
    """The pieces that make every rank of ``new_world`` hold its new shard of every tensor.

    ``holders``: old shard -> the new ranks that hold it whole. A receiver that holds the
    old shard itself copies locally (holder == receiver); otherwise the range is cut
    into one stripe per holder, so the holders send in parallel. ``receivers``: the
    rank that takes new shard ``i`` (default: rank ``i``); a hybrid mesh plans each
    replica group's shards this way (hybrid_plan.plan_restore)."""
    missing = [s for s in range(old_world) if not holders.get(s)]
    if missing:
        raise ValueError(f"old shards {missing} are held by nobody")
    ranks = list(receivers) if receivers is not None else list(range(new_world))
    if len(ranks) != new_world:
        raise ValueError(f"{len(ranks)} receivers for a world of {new_world}")
    pieces: list[Piece] = []
    for tensor in layout:
        per_row = tensor.row_elements
        for index, receiver in enumerate(ranks):
            new_start, new_end = shard_rows(tensor.rows, new_world, index)
            for shard in range(old_world):
                old_start, old_end = shard_rows(tensor.rows, old_world, shard)
                low, high = max(new_start, old_start), min(new_end, old_end)
                if low >= high:
                    continue
                src, dst, length = (low - old_start) * per_row, (low - new_start) * per_row, (high - low) * per_row
                sources = sorted(holders[shard])
                if receiver in sources:
                    sources = [receiver]
                for stripe, holder in enumerate(sources):
                    cut, next_cut = length * stripe // len(sources), length * (stripe + 1) // len(sources)
                    if cut < next_cut:
                        pieces.append(Piece(tensor.key, shard, holder, receiver, src + cut, dst + cut, next_cut - cut))
    return pieces


def bytes_moved(pieces: Sequence[Piece], itemsize: Mapping[str, int]) -> int:
    """Bytes that cross the network (local copies excluded)."""
    return sum(p.length * itemsize[p.key] for p in pieces if p.holder != p.receiver)
