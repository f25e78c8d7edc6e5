"""What a ``ShardedState`` keeps about its commits: the shard slots it holds, the copies in flight.

The user's names (``state.model``, ``state.epoch`` ...) are the state's attributes; all of
this lives in its one private attribute, ``_book`` (``elastic/commit_book.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..commit_book import CommitBook
from . import modules
from .durable import ShardedCheckpoints
from .slots import Replication, ShardSlot


@dataclass
class ShardBook(CommitBook):
    """A ``ShardedState``'s bookkeeping (``elastic/commit_book.py``), in its one private attribute."""

    # How every ring builds the model: the user's factories.
    model_factory: Callable[[], torch.nn.Module] = None
    optimizer_factory: Optional[Callable] = None
    shard: Callable = modules.default_shard
    init: Optional[Callable] = None
    scheduler_factory: Optional[Callable] = None
    # Durable checkpoints (--checkpoint-dir): ShardedCheckpoints, made on the first sync.
    durable: Optional[ShardedCheckpoints] = None
    durable_resolved: bool = False
    # The commits this rank holds: its own slot, its last two, the old ring's (legacy, until
    # the new ring's first commit is in everywhere), other owners' replicas and the spares
    # their next copies arrive in, and the commits' metas by (commit, world).
    own: Optional[ShardSlot] = None
    own_older: list = field(default_factory=list)
    legacy: list = field(default_factory=list)
    confirm_ring: bool = False  # the next commit confirms the new ring's copies (one all-reduce)
    replicas: dict = field(default_factory=dict)
    spares: dict = field(default_factory=dict)
    metas: dict = field(default_factory=dict)
    replication: Optional[Replication] = None  # the copies in flight
    holders: tuple = ()  # who keeps copies of whose shards in this ring (placement.py) ...
    holders_for: Optional[tuple] = None  # ... for which (plan, count)
    live: Optional[object] = None  # the live DTensors' local tensors, found once (live_shards.py)
    last_reshard_bytes: int = 0  # received by the last re-shard (benchmarks/sharded.py)
