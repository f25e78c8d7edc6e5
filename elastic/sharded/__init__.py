"""Sharded data parallel (FSDP2) that survives losing a host: ``ShardedState`` and ``device_mesh``.

Part of the API room: may import elastic/worker, elastic/contract, rendezvous and checkpoint.
"""

from .mesh import device_mesh
from .state import ShardedState

__all__ = ["ShardedState", "device_mesh"]
