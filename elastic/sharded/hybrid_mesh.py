"""The round's hybrid ``DeviceMesh`` (replicate x shard [x tp]), split from the ring's one process group.

Every round has one process group over all its workers (the ring). A hybrid mesh is cut
out of it: one sub-group per line of each mesh dimension (``dist.new_group``; every rank
of the ring makes every one, in the same order, spares included), and the
``DeviceMesh`` is assembled from this rank's lines (``DeviceMesh.from_group``). A spare
is in no line: it gets no mesh. The mesh belongs to its round; take it anew on each
entry of the training function.

``round_facts`` is the one place that reads what the hybrid code needs of the round's ring,
and ``adopt_connections`` the one that tells the ring of the groups cut out of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..contract.errors import ElasticError
from ..worker.ring_view import RingView
from .hybrid_plan import FLAT, HYBRID, HybridShape, MeshPlan, plan_mesh

DIMS_2D = ("replicate", "shard")
DIMS_3D = ("replicate", "shard", "tp")

_current: dict = {}  # {"round": n, "plan": MeshPlan, "mesh": DeviceMesh or None}


@dataclass(frozen=True)
class RoundFacts:
    """What the hybrid code reads of the current round."""

    round: int
    rank: int
    world_size: int
    workers: tuple[str, ...]  # worker id per rank
    hosts: tuple[str, ...]  # host (agent member) per rank
    backend: str


def round_facts(ring: RingView) -> RoundFacts:
    """The round's facts, from its ring (the one adapter between the hybrid code and the ring)."""
    plan = ring.plan
    if plan is None:  # a world of one without elastic-run
        return RoundFacts(ring.round, 0, 1, ("local",), ("local",), ring.backend)
    return RoundFacts(plan.round, ring.rank, plan.world_size, tuple(s.worker_id for s in plan.slots),
                      tuple(s.member_id for s in plan.slots), ring.backend)


def adopt_connections(ring: RingView, before) -> None:
    """Groups made on the ring since ``before`` are aborted with it: their collectives must
    wake when the ring is aborted (``RingHandle.include_since``). A world of one has no handle."""
    if ring.handle is not None:
        ring.handle.include_since(before)


def default_shard_size(hosts: Sequence[str]) -> int:
    """A host's local world size: the most workers any host has in the ring."""
    counts: dict[str, int] = {}
    for host in hosts:
        counts[host] = counts.get(host, 0) + 1
    return max(counts.values())


def mesh_tensor(plan: MeshPlan) -> torch.Tensor:
    """Ranks as a (groups, shard[, tp]) tensor."""
    shape = plan.shape
    dims = (len(plan.groups), shape.shard_size) + ((shape.tensor_parallel,) if shape.tensor_parallel > 1 else ())
    return torch.tensor([list(g) for g in plan.groups], dtype=torch.int64).reshape(dims)


def build_mesh(plan: MeshPlan, rank: int, device_type: str):
    """This rank's hybrid ``DeviceMesh`` (None for a spare); every rank of the ring calls it."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = mesh_tensor(plan)
    names = DIMS_3D if ranks.dim() == 3 else DIMS_2D
    mine = []
    for dim in range(ranks.dim()):
        lines = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
        found = None
        for line in lines:  # the same order on every rank: new_group is collective over the ring
            group = dist.new_group(ranks=line)  # the ring's backend
            if rank in line:
                found = group
        mine.append(found)
    if not plan.trains(rank):
        return None
    return DeviceMesh.from_group(mine, device_type, mesh=ranks, mesh_dim_names=names)


def remember(round_number: int, plan: MeshPlan, mesh) -> None:
    """The round's mesh, as the hybrid state built it: what ``device_mesh(dims)`` returns."""
    _current.clear()
    _current.update(round=round_number, plan=plan, mesh=mesh)


def current_plan(round_number: int) -> Optional[MeshPlan]:
    return _current["plan"] if _current.get("round") == round_number else None


def hybrid_device_mesh(ring: RingView, dims: Sequence[str], shard_size: Optional[int], tensor_parallel: int,
                       device_type: str):
    """``elastic.device_mesh(("replicate", "shard"), shard_size=S)``: the round's hybrid mesh.

    Under a ``HybridShardedState`` it is the mesh the state trains on (None on a spare).
    Without one, the ring is cut per host into groups of ``shard_size`` (default: a host's
    local world size); workers left over would be spares, which a script of its own cannot
    handle: refused with a clear error."""
    if tuple(dims) not in (DIMS_2D, DIMS_3D):
        raise ElasticError(f"elastic.device_mesh: dims must be {DIMS_2D} or {DIMS_3D}, got {tuple(dims)}")
    if not dist.is_initialized():
        raise ElasticError("elastic.device_mesh() needs a process group: run the script with elastic-run")
    facts = round_facts(ring)
    if _current.get("round") == facts.round:
        plan = _current["plan"]
        if plan.mode == FLAT:
            raise ElasticError(f"round {facts.round} trains on a flat 1-D mesh (fewer than "
                               f"{plan.shape.min_groups} complete groups): take elastic.device_mesh()")
        return _current["mesh"]
    size = shard_size or default_shard_size(facts.hosts)
    shape = HybridShape(size, tensor_parallel if len(dims) == 3 else 1, min_groups=1)
    plan = plan_mesh(facts.workers, facts.hosts, {}, shape)
    if plan.mode != HYBRID or plan.spares:
        raise ElasticError(f"round {facts.round}: {facts.world_size} workers on hosts {sorted(set(facts.hosts))} "
                           f"do not make whole groups of {shape.group_size}; HybridShardedState handles spares")
    from ..worker.ring_abort import socket_snapshot

    before = socket_snapshot()
    mesh = build_mesh(plan, facts.rank, device_type)
    adopt_connections(ring, before)
    remember(facts.round, plan, mesh)
    return mesh
