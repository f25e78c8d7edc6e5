"""The global order of a sharded data set and each rank's share of it: pure functions.

Everything a resume at another world size depends on is decided here, from values
only (the shards' sample counts, the settings, the epoch, the cursor), so the same
inputs give the same answer on every worker, in every process, in every later run:

* ``EpochOrder``: position ``p`` of epoch ``e`` -> a global sample id. The shards are
  put in an order drawn from ``(seed, epoch)``; their samples, one after the other in
  that order, are cut into windows of ``window`` positions, and each window is
  shuffled with its own key ``(seed, epoch, window number)``. A reader touches about
  ``window / shard size + 1`` shards at a time (locality for memory-mapped and
  row-group reads); ``window >= samples`` shuffles the whole epoch.
* ``batch_bounds``: the global batch a step trains: positions ``[cursor, cursor + G)``
  of the order, cut at the epoch's end (a last, smaller batch, or none with
  ``drop_last``). No batch depends on the world size.
* ``rank_share``: rank ``r`` of ``W`` reads positions ``r, r + W, ...`` of a batch
  (sizes differ by at most one; disjoint; together the batch).
* ``cursor_after``: the cursor a step leaves; a re-formation resumes from the
  committed one (``resume_cursor``), whatever the new world.

The shuffles are keyed hashes (splitmix64 over ``uint64``, then a stable sort), not a
library's random stream: numpy's and torch's generators do not promise the same
stream across their versions, and an order that changed under a resume would train
some samples twice and others never.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

_MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser on a Python int (the key of a shuffle)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def shuffle_key(*parts: int) -> int:
    """One 64-bit key from integers (seed, epoch, window): each part is mixed in turn."""
    key = 0x243F6A8885A308D3
    for part in parts:
        key = _mix(key ^ (int(part) & _MASK))
    return key


def keyed_permutation(n: int, key: int) -> np.ndarray:
    """A permutation of ``range(n)`` that depends on ``key`` only (int64 array)."""
    with np.errstate(over="ignore"):
        x = np.arange(n, dtype=np.uint64) + np.uint64(key)
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return np.argsort(x, kind="stable").astype(np.int64)


@dataclass(frozen=True)
class OrderSettings:
    """What the order is made of; committed with the cursor and compared on a resume."""

    seed: int = 0
    shuffle: bool = True
    window: int = 8192  # positions shuffled together (see the module doc)

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")


def shard_order(num_shards: int, settings: OrderSettings, epoch: int) -> list[int]:
    """The shards in the order epoch ``epoch`` reads them."""
    if not settings.shuffle:
        return list(range(num_shards))
    return keyed_permutation(num_shards, shuffle_key(settings.seed, epoch, 0x5A4D)).tolist()


class EpochOrder:
    """Position -> global sample id for one epoch (O(shards) memory, one window cached).

    A sample's global id is its shard's first id (shards counted in the order given,
    not the epoch's) plus its offset in the shard: ids do not change between epochs.
    """

    def __init__(self, counts: Sequence[int], settings: OrderSettings, epoch: int):
        self.counts = [int(c) for c in counts]
        self.settings = settings
        self.epoch = int(epoch)
        self.total = sum(self.counts)
        first_ids = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])[:-1] if self.counts else []
        self.shards = shard_order(len(self.counts), settings, self.epoch)
        # Where each shard of the epoch's order starts among the epoch's positions.
        self._starts = [0]
        for shard in self.shards:
            self._starts.append(self._starts[-1] + self.counts[shard])
        self._first_ids = [int(first_ids[shard]) for shard in self.shards]
        self._window: Optional[tuple[int, np.ndarray]] = None

    def _unshuffled(self, positions: np.ndarray) -> np.ndarray:
        """Ids of positions in the shards' order, before the windows' shuffle."""
        starts = np.asarray(self._starts[:-1], dtype=np.int64)
        slot = np.searchsorted(starts, positions, side="right") - 1
        # Skip empty shards: the last start <= p whose shard holds p.
        return np.asarray(self._first_ids, dtype=np.int64)[slot] + (positions - starts[slot])

    def _window_permutation(self, number: int) -> np.ndarray:
        if self._window is None or self._window[0] != number:
            size = min(self.settings.window, self.total - number * self.settings.window)
            self._window = (number, keyed_permutation(size, shuffle_key(self.settings.seed, self.epoch, number)))
        return self._window[1]

    def ids(self, start: int, end: int) -> np.ndarray:
        """The global ids at positions ``[start, end)`` of the epoch (int64 array)."""
        if not 0 <= start <= end <= self.total:
            raise ValueError(f"positions [{start}, {end}) are outside the epoch's [0, {self.total})")
        positions = np.arange(start, end, dtype=np.int64)
        if self.settings.shuffle and self.settings.window > 1:
            window = self.settings.window
            shuffled = np.empty_like(positions)
            for number in range(start // window, (end - 1) // window + 1 if end > start else 0):
                lo, hi = max(start, number * window), min(end, (number + 1) * window)
                base = number * window
                shuffled[lo - start:hi - start] = base + self._window_permutation(number)[lo - base:hi - base]
            positions = shuffled
        return self._unshuffled(positions)

    def locate(self, sample_id: int) -> tuple[int, int]:
        """(shard, offset) of a global sample id."""
        return locate(self.counts, sample_id)


def first_ids(counts: Sequence[int]) -> list[int]:
    """The global id of each shard's first sample."""
    out, total = [], 0
    for count in counts:
        out.append(total)
        total += int(count)
    return out


def locate(counts: Sequence[int], sample_id: int, starts: Optional[Sequence[int]] = None) -> tuple[int, int]:
    """(shard, offset) of global sample id ``sample_id`` (``starts``: ``first_ids(counts)``)."""
    starts = first_ids(counts) if starts is None else starts
    total = (starts[-1] + int(counts[-1])) if counts else 0
    if not 0 <= sample_id < total:
        raise IndexError(f"sample id {sample_id} is outside [0, {total})")
    # The last shard starting at or before the id: empty shards share the next one's start.
    shard = bisect.bisect_right(starts, sample_id) - 1
    return shard, sample_id - starts[shard]


def batch_bounds(cursor: int, total: int, global_batch_size: int, drop_last: bool) -> Optional[tuple[int, int]]:
    """[start, end) of the global batch a step at ``cursor`` trains; None at the epoch's end."""
    if cursor >= total:
        return None
    end = min(cursor + global_batch_size, total)
    if drop_last and end - cursor < global_batch_size:
        return None
    return cursor, end


def steps_left(cursor: int, total: int, global_batch_size: int, drop_last: bool) -> int:
    """How many global batches remain in the epoch from ``cursor``."""
    left = max(0, total - cursor)
    full, rest = divmod(left, global_batch_size)
    return full + (1 if rest and not drop_last else 0)


def rank_share(start: int, end: int, world: int, rank: int) -> range:
    """Positions of batch ``[start, end)`` that rank ``rank`` of ``world`` reads."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    return range(start + rank, end, world)


def cursor_after(cursor: int, total: int, global_batch_size: int, drop_last: bool) -> int:
    """The cursor once the step at ``cursor`` is trained (its whole global batch, on every rank)."""
    bounds = batch_bounds(cursor, total, global_batch_size, drop_last)
    return cursor if bounds is None else bounds[1]


def resume_cursor(committed: int, trained_since_commit: int, rolled_back: bool) -> int:
    """The cursor a re-formed ring starts from.

    After a failure the ring rolls back to its last commit: the steps trained since are
    trained again (their samples were never counted, the model forgot them). A switch
    (a join, a graceful leave) happens at a commit, so nothing was trained since it.
    The world size does not enter: positions are the same in every world.
    """
    if rolled_back or trained_since_commit == 0:
        return committed
    raise ValueError(f"a switch happens at a commit, but {trained_since_commit} steps were trained since it")
