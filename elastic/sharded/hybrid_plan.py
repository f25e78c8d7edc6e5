"""Who trains in which replica group after a loss or a join, and who sends what to whom: pure functions.

A hybrid-sharded (HSDP) job trains on a 2-D mesh ("replicate", "shard"), or 3-D with a
tensor-parallel dimension inside the group ("replicate", "shard", "tp"): replica
*groups* of ``shard_size * tensor_parallel`` workers, each group on one host, each holding
a whole copy of the model sharded across its workers; the groups are replicas of each
other. The unit of elasticity is a complete group:

- ``plan_mesh``: a group whose every worker is still in the ring goes on as it was (same
  workers, same coordinates: nothing moves). The survivors of a broken group and the
  workers that joined are pooled per host and cut into new groups of the full size; what
  is left over on a host waits as a *spare* (it does not train and keeps its shards)
  until a replacement completes its group. With fewer than ``min_groups`` complete
  groups the ring falls back to the 1-D path (every worker trains, the model is
  re-sharded across all of them), unless the group holds a tensor-parallel dimension,
  which only a complete group can carry: then the complete groups that are left go on.
- ``plan_refill``: a worker at coordinate ``c`` of a group that must be filled takes
  the shard slot of coordinate ``c`` from the workers holding it (a healthy replica),
  striped across them; one that holds it already copies locally.
- ``data_share``: which rows of a constant global batch a worker trains on. Spares take
  none; every training worker counts once (tensor-parallel peers share one share), so
  the replicas that are left take the lost replica's rows between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

HYBRID, FLAT, NONE = "hybrid", "flat", "none"


@dataclass(frozen=True)
class HybridShape:
    """The mesh a job asks for: ``shard_size`` FSDP shards times ``tensor_parallel`` per group."""

    shard_size: int
    tensor_parallel: int = 1
    min_groups: int = 2

    def __post_init__(self):
        if self.shard_size < 1 or self.tensor_parallel < 1 or self.min_groups < 1:
            raise ValueError(f"a hybrid mesh needs shard_size, tensor_parallel and min_groups >= 1, got {self}")

    @property
    def group_size(self) -> int:
        return self.shard_size * self.tensor_parallel


@dataclass(frozen=True)
class MeshPlan:
    """One round's mesh: ``groups`` (ranks in coordinate order, shard-major then tp) train,
    ``spares`` wait. ``FLAT``: every rank trains on a 1-D mesh; ``NONE``: nobody can."""

    mode: str
    world: int
    shape: HybridShape
    groups: tuple[tuple[int, ...], ...] = ()
    spares: tuple[int, ...] = ()
    kept: tuple[int, ...] = ()  # indices into groups of those that went on unchanged

    def place(self, rank: int) -> Optional[tuple[int, int]]:
        """(replica group, coordinate in it) of a training rank of a hybrid mesh, else None."""
        for index, group in enumerate(self.groups):
            if rank in group:
                return index, group.index(rank)
        return None

    @property
    def training(self) -> tuple[int, ...]:
        if self.mode == FLAT:
            return tuple(range(self.world))
        return tuple(sorted(r for group in self.groups for r in group))

    def trains(self, rank: int) -> bool:
        return rank in self.training

    def describe(self) -> str:
        if self.mode == FLAT:
            return f"flat 1-D mesh of {self.world}"
        if self.mode == NONE:
            return f"no complete group of {self.shape.group_size} (spares {list(self.spares)})"
        dims = f"{len(self.groups)}x{self.shape.shard_size}" + (
            f"x{self.shape.tensor_parallel}" if self.shape.tensor_parallel > 1 else "")
        return f"{dims} groups {[list(g) for g in self.groups]}" + (f", spares {list(self.spares)}" if self.spares else "")


def plan_mesh(workers: Sequence[str], hosts: Sequence[str], previous: Mapping[str, Sequence[str]],
              shape: HybridShape) -> MeshPlan:
    """This round's groups and spares.

    ``workers[r]``, ``hosts[r]``: rank r's worker id and host; ``previous``: worker id ->
    the group (worker ids in coordinate order) it trained in last round, for the workers
    that had one. Groups that are complete go on; the others' survivors and the joiners
    are cut per host into new groups; the rest are spares (module docstring)."""
    if len(workers) != len(hosts) or len(set(workers)) != len(workers):
        raise ValueError("one distinct worker id and one host per rank")
    rank_of = {w: r for r, w in enumerate(workers)}
    size = shape.group_size
    kept: list[tuple[int, ...]] = []
    seen: set[tuple[str, ...]] = set()
    for worker in workers:
        group = tuple(previous.get(worker) or ())
        if len(group) != size or group in seen or not all(w in rank_of for w in group):
            continue
        if len({hosts[rank_of[w]] for w in group}) != 1:
            continue  # (a group never spans hosts; a malformed report cannot make one)
        seen.add(group)
        kept.append(tuple(rank_of[w] for w in group))
    in_kept = {r for group in kept for r in group}
    pool: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        if rank not in in_kept:
            pool.setdefault(host, []).append(rank)
    new: list[tuple[int, ...]] = []
    spares: list[int] = []
    for ranks in pool.values():
        whole = len(ranks) // size * size
        new += [tuple(ranks[i:i + size]) for i in range(0, whole, size)]
        spares += ranks[whole:]
    groups = sorted(kept + new, key=lambda g: g[0])
    kept_index = tuple(i for i, g in enumerate(groups) if g in kept)
    world = len(workers)
    if len(groups) >= shape.min_groups:
        return MeshPlan(HYBRID, world, shape, tuple(groups), tuple(sorted(spares)), kept_index)
    if shape.tensor_parallel == 1:
        return MeshPlan(FLAT, world, shape)
    if groups:  # a tensor-parallel group cannot be re-sharded over a 1-D ring: the complete ones go on
        return MeshPlan(HYBRID, world, shape, tuple(groups), tuple(sorted(spares)), kept_index)
    return MeshPlan(NONE, world, shape, (), tuple(range(world)))


def data_share(plan: MeshPlan, rank: int) -> Optional[tuple[int, int]]:
    """(index, count) of ``rank``'s share of every global batch (``b[index::count]``), or
    None for a spare. Tensor-parallel peers (same group and shard) share one index."""
    if plan.mode == FLAT:
        return rank, plan.world
    place = plan.place(rank)
    if place is None:
        return None
    group, coordinate = place
    shards = plan.shape.shard_size
    return group * shards + coordinate // plan.shape.tensor_parallel, len(plan.groups) * shards


def replica_rows(global_batch: int, plan: MeshPlan) -> list[int]:
    """Rows of a global batch each replica group trains (``data_share``'s split summed per
    group): the same ``global_batch`` however many groups are left."""
    count = {}
    for rank in plan.training:
        share = data_share(plan, rank)
        count[share] = len(range(share[0], global_batch, share[1]))
    if plan.mode == FLAT:
        return [sum(count.values())]
    shards = plan.shape.shard_size
    return [sum(count[(g * shards + s, len(plan.groups) * shards)] for s in range(shards))
            for g in range(len(plan.groups))]


@dataclass(frozen=True)
class SlotPiece:
    """``length`` elements of the ``dtype`` buffer of slot ``coordinate``, from
    element ``start``: ``holder`` -> ``receiver`` (the same range on both ends)."""

    coordinate: int
    holder: int
    receiver: int
    dtype: str
    start: int
    length: int


def plan_refill(needs: Mapping[int, int], holders: Mapping[int, Sequence[int]],
                sizes: Mapping[int, Mapping[str, int]]) -> list[SlotPiece]:
    """The pieces that give every receiver (``needs``: rank -> coordinate) the whole slot of
    its coordinate. ``holders``: coordinate -> ranks holding that slot of the chosen
    commit; ``sizes``: coordinate -> elements per dtype buffer of its slot (FSDP2's
    chunks are uneven: the last coordinates may hold fewer rows). A receiver holding it already
    moves nothing (it copies locally); the others get each buffer cut into one stripe per
    holder, so a refilled group's shards come from every healthy replica in parallel."""
    pieces: list[SlotPiece] = []
    for receiver in sorted(needs):
        coordinate = needs[receiver]
        sources = sorted(holders.get(coordinate, ()))
        if not sources:
            raise ValueError(f"slot {coordinate} is held by nobody")
        if receiver in sources:
            continue
        for dtype, total in sorted(sizes[coordinate].items()):
            for stripe, holder in enumerate(sources):
                start, end = total * stripe // len(sources), total * (stripe + 1) // len(sources)
                if start < end:
                    pieces.append(SlotPiece(coordinate, holder, receiver, dtype, start, end - start))
    return pieces
