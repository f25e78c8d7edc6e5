"""Where each rank's committed shards keep their replicas: a pure function.

Rank ``r``'s replicas go to the next ranks around the ring that sit on *other* hosts
(members), so that losing a host never loses a shard together with all its copies;
only when the ring has fewer other hosts than ``--shard-replicas`` asks for do copies
fall back to other workers of the same host. Among the candidates the rank holding
the fewest replicas so far wins (ties: the nearest around the ring), which spreads
the replicas evenly when ranks are grouped by host.
"""

from __future__ import annotations

from typing import Sequence


def replica_holders(members: Sequence[str], replicas: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, the ranks keeping a copy of its shards (``members[r]``: rank r's host)."""
    if replicas < 0:
        raise ValueError(f"--shard-replicas must be >= 0, got {replicas}")
    world = len(members)
    load = [0] * world
    chosen: list[tuple[int, ...]] = []
    for rank in range(world):
        around = [(rank + k) % world for k in range(1, world)]
        mine: list[int] = []
        hosts_used = {members[rank]}  # the owner's host has the owner's copy
        while len(mine) < min(replicas, world - 1):
            left = [r for r in around if r not in mine]
            # A second copy on a host that already has one buys nothing against losing
            # that host: new hosts first, then the least loaded, then the nearest.
            best = min(left, key=lambda r: (members[r] in hosts_used, load[r], around.index(r)))
            mine.append(best)
            hosts_used.add(members[best])
            load[best] += 1
        chosen.append(tuple(mine))
    return tuple(chosen)


def replicas_of(holders: Sequence[Sequence[int]], rank: int) -> tuple[int, ...]:
    """The ranks whose shards ``rank`` keeps a copy of."""
    return tuple(owner for owner, mine in enumerate(holders) if rank in mine)
