"""Who sends which part of the state to whom when a ring syncs: pure functions.

After a re-formation every worker reports what it holds (``Holding``): the identity of
its last commit, or nothing. The ring's newest commit is the largest identity; the
workers that hold it are the *holders*, everybody else receives it. A holder never
receives: survivors that already hold the newest commit move nothing.

A commit's identity is (the round in which it was made, the commit count). The count
alone is ambiguous: a worker cut off after making commit 11 in round 4 can come back
to a ring that rolled back to 10 in round 5 and made its own, different, commit 11.
Every commit of a ring is made from the newest commit its members held when it
formed, and rounds only grow, so a commit made in a later round descends from
everything the ring went on from; within one round, counts order the commits.

The state travels as the snapshot's flat buffers. They are laid out one after the
other in one space of bytes, each starting on a multiple of ``ALIGN`` bytes; holder
``h`` of ``H`` sends the ``h``-th ``H``-th of that space (its *stripe*, cut at
multiples of ``ALIGN``, so every cut falls between two elements), in chunks of at
most ``chunk_bytes``, to every receiver. Each receiver gets every byte exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

ALIGN = 64  # bytes; a multiple of every element size, so stripe cuts fall between elements


@dataclass(frozen=True, order=True)
class CommitId:
    """Which commit a worker holds: compared as (round, count)."""

    round: int  # the round in which the commit was made (0: before any round, e.g. initial state)
    count: int  # commits made by the job up to and including this one


@dataclass(frozen=True)
class Holding:
    """What one rank reported: its commit's identity, or None (it holds no usable commit)."""

    rank: int
    commit: Optional[CommitId]


@dataclass(frozen=True)
class Transfer:
    """``length`` elements of buffer ``buffer`` from element ``start``, holder -> receiver."""

    holder: int
    receiver: int
    buffer: int
    start: int
    length: int


@dataclass(frozen=True)
class SyncPlan:
    newest: Optional[CommitId]  # None: nobody holds a commit; the source (rank 0) sends its state
    holders: tuple[int, ...]
    receivers: tuple[int, ...]
    transfers: tuple[Transfer, ...]

    def sends(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.holder == rank]

    def receives(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.receiver == rank]


def choose_holders(holdings: Sequence[Holding]) -> tuple[Optional[CommitId], tuple[int, ...], tuple[int, ...]]:
    """(newest commit, holders, receivers). When nobody holds a commit (a fresh job, or
    one restarted from disk), the lowest rank is the only holder: it loads the newest
    durable checkpoint, if any, and everybody else takes its state."""
    ranks = sorted(h.rank for h in holdings)
    if len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"one report per rank expected, got ranks {ranks}")
    held = [h.commit for h in holdings if h.commit is not None]
    newest = max(held) if held else None
    if newest is None:
        holders = (ranks[0],)
    else:
        holders = tuple(sorted(h.rank for h in holdings if h.commit == newest))
    receivers = tuple(r for r in ranks if r not in holders)
    return newest, holders, receivers


@dataclass(frozen=True)
class ClaimBounds:
    """What a worker knows, without asking anybody, about the commits its ring may hold.

    ``current``: the round being synced. ``previous``: the round this worker trained in
    last, when the commit it holds was made there (it is a survivor of that ring), with
    ``members``, the current ranks that were in that ring, and ``mine``, its commit."""

    current: int
    previous: Optional[int] = None
    members: frozenset = frozenset()
    mine: Optional[CommitId] = None


def implausible_claim(holdings: Sequence[Holding], bounds: ClaimBounds) -> Optional[str]:
    """Why one of ``holdings`` cannot be true, or None. A commit is made in a round that
    formed, so never in a later round than the current one. The ring of one round
    commits in lockstep (each step has a collective), so none of its members is more
    than one commit ahead of another, and only its members made commits in it.

    Not caught (it would take asking etcd or the peers): a member of the previous ring
    that claims one commit more than the survivors hold; a claim of a round between
    the survivor's last one and the current one (rounds that may have formed without
    it); a peer whose commit is the real one in identity but not in content."""
    for h in holdings:
        c = h.commit
        if c is None:
            continue
        if c.round < 0 or c.count < 0:
            return f"rank {h.rank} claims commit {c.count} of round {c.round}: negative"
        if c.round > bounds.current:
            return f"rank {h.rank} claims a commit of round {c.round}, after the current round {bounds.current}"
        if bounds.previous is not None and c.round == bounds.previous:
            if h.rank not in bounds.members:
                return f"rank {h.rank} claims a commit of round {c.round}, whose ring it was not in"
            if bounds.mine is not None and c.count > bounds.mine.count + 1:
                return (f"rank {h.rank} claims commit {c.count} of round {c.round}, more than one ahead "
                        f"of this worker's {bounds.mine.count} in the same ring")
    return None


def stripes(buffer_bytes: Sequence[int], parts: int) -> list[list[tuple[int, int, int]]]:
    """Per part, its (buffer, start byte, end byte) pieces; the parts cover every byte once."""
    if parts < 1:
        raise ValueError("at least one part")
    offsets, position = [], 0
    for size in buffer_bytes:
        offsets.append(position)
        position += -(-size // ALIGN) * ALIGN
    total = position // ALIGN  # in units of ALIGN bytes
    cuts = [(total * p // parts) * ALIGN for p in range(parts + 1)]
    pieces: list[list[tuple[int, int, int]]] = []
    for low, high in zip(cuts, cuts[1:]):
        mine = []
        for index, (offset, size) in enumerate(zip(offsets, buffer_bytes)):
            start, end = max(low, offset) - offset, min(high, offset + size) - offset
            if start < end:
                mine.append((index, start, end))
        pieces.append(mine)
    return pieces


def plan_sync(holdings: Sequence[Holding], buffers: Sequence[tuple[int, int]], chunk_bytes: int) -> SyncPlan:
    """The transfers of a sync. ``buffers``: (number of elements, element size) of each
    flat buffer of the newest commit's snapshot, in order."""
    if chunk_bytes < ALIGN or chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes}")
    newest, holders, receivers = choose_holders(holdings)
    transfers = []
    if receivers:
        for holder, pieces in zip(holders, stripes([n * size for n, size in buffers], len(holders))):
            for index, start, end in pieces:
                itemsize = buffers[index][1]
                for low in range(start, end, chunk_bytes):
                    high = min(end, low + chunk_bytes)
                    for receiver in receivers:
                        transfers.append(Transfer(holder, receiver, index, low // itemsize, (high - low) // itemsize))
    return SyncPlan(newest, holders, receivers, tuple(transfers))
