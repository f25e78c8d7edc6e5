"""The current ring's 1-D ``DeviceMesh``, rebuilt once per round."""

from __future__ import annotations

import torch.distributed as dist

from ..contract.errors import ElasticError
from ..worker.lifecycle import current as _runtime

_cached: dict = {}  # {"key": (round, group), "mesh": DeviceMesh}


def device_type(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


def device_mesh():
    """The 1-D mesh over every rank of the current ring (its default process group).

    A new object after every re-formation: a mesh of an earlier round names a process
    group that no longer exists, so take it from here on each entry of the training
    function, never keep it across one."""
    from torch.distributed.device_mesh import DeviceMesh

    runtime = _runtime()
    if not dist.is_initialized():
        raise ElasticError("elastic.device_mesh() needs a process group: run the script with elastic-run")
    group = dist.group.WORLD
    key = (runtime.round, id(group), dist.get_world_size())
    if _cached.get("key") != key:
        _cached["mesh"] = DeviceMesh.from_group(group, device_type(runtime.backend))
        _cached["key"] = key
    return _cached["mesh"]
