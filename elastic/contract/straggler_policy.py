"""What the launcher, the agent and the workers agree on about stragglers: the options,
and when evicting one is allowed (the detection itself is ``elastic/worker/stragglers.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StragglerOptions:
    """``elastic-run --straggler-ratio / --evict-stragglers``."""

    ratio: float = 1.5
    evict: bool = False


def remaining_after(world_size: int, leaving: int) -> int:
    """Workers left when ``leaving`` of ``world_size`` go."""
    return world_size - leaving


def eviction_allowed(world_size: int, leaving: int, min_np: int) -> bool:
    """Evicting is allowed only while the rest keeps the job at or above --min-np:
    below it the coordinator would stop the whole job instead."""
    return leaving > 0 and remaining_after(world_size, leaving) >= min_np
