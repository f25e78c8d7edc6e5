"""Sharded data parallel (FSDP2, and hybrid HSDP) that survives losing a host: ``ShardedState``,
``HybridShardedState`` and ``device_mesh``.

Part of the API room: may import elastic/worker, elastic/contract, rendezvous and checkpoint.
"""

from .hybrid_state import HybridShardedState
from .mesh import device_mesh
from .state import ShardedState

__all__ = ["HybridShardedState", "ShardedState", "device_mesh"]
