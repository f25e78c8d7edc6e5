"""The current ring's 1-D ``DeviceMesh``, rebuilt once per round."""

from __future__ import annotations

import torch.distributed as dist

from ..contract.devices import capability
from ..contract.errors import ElasticError
from ..worker import lifecycle

_cached: dict = {}  # {"key": (round, group), "mesh": DeviceMesh}


def device_type(backend: str) -> str:
    """Where the sharded model lives under ``backend``: CUDA when CUDA tensors travel over
    NCCL (``nccl``, the default ``cpu:gloo,cuda:nccl``), else the CPU. A backend with no
    part for host tensors is refused: the sharded state's commits live in host memory and
    travel between ranks as host tensors."""
    found = capability(backend)
    if found.host_backend is None:
        raise ElasticError(f"ShardedState needs a backend that carries host tensors, and {backend!r} has none: "
                           f"run with --backend auto (cpu:gloo,cuda:nccl on GPU hosts)")
    return found.model_device


def device_mesh(dims=None, *, shard_size=None, tensor_parallel: int = 1):
    """The 1-D mesh over every rank of the current ring (its default process group), or
    with ``dims=("replicate", "shard")`` (or ``+ ("tp",)``) the round's hybrid mesh
    (``hybrid_mesh.hybrid_device_mesh``).

    A new object after every re-formation: a mesh of an earlier round names a process
    group that no longer exists, so take it from here on each entry of the training
    function, never keep it across one."""
    from torch.distributed.device_mesh import DeviceMesh

    ring = lifecycle.ring()
    if dims is not None and len(dims) > 1:
        from .hybrid_mesh import hybrid_device_mesh

        return hybrid_device_mesh(ring, dims, shard_size, tensor_parallel, device_type(ring.backend))
    if not dist.is_initialized():
        raise ElasticError("elastic.device_mesh() needs a process group: run the script with elastic-run")
    group = dist.group.WORLD
    key = (ring.round, id(group), dist.get_world_size())
    if _cached.get("key") != key:
        _cached["mesh"] = DeviceMesh.from_group(group, device_type(ring.backend))
        _cached["key"] = key
    return _cached["mesh"]
