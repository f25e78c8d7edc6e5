"""SourceSampler: each step's global batch of a ShardedSource, exactly once at any world size.

The sampler is the ``batch_sampler`` of a ``DataLoader`` over a ``ShardedSource`` and
the ``sampler=`` of a ``TorchState``. Its state is one integer, the **cursor**: how many
positions of the epoch's order (``order.py``) the job has trained, plus the epoch and
the settings the order and the batches are made of. With ``G`` the global batch size:

* a pass (one iteration of the loader) starts at the cursor and yields, for each step,
  this rank's share of the next ``G`` positions (``order.rank_share``): the batch does
  not depend on the world size, only the shares do;
* ``record_batch(k)`` after step ``k`` of the pass (on every rank, after the
  synchronous step) moves the cursor past that batch. Only then is it consumed: what
  the loader's workers prefetched and the job has not trained is not counted, and a
  rollback (``load_state_dict`` of the last commit) puts the cursor back;
* after a re-formation the runtime calls ``set_rank`` (the ``sampler=`` of a
  ``TorchState`` gets it) and the next pass lays the same positions out over the new
  world. A ``DataLoader(persistent_workers=True)`` keeps its worker processes: a new
  pass only sends them other ids.

A resume that changes a setting (seed, shuffle, window, global batch size, drop_last,
or the data: the index's digest) is refused in one line naming each: the cursor counts
positions of one particular order, and in another order it would mark other samples
trained than those that were.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional, Sequence

from torch.utils.data import Sampler

from .index import ShardIndex, counts_digest
from .order import EpochOrder, OrderSettings, batch_bounds, rank_share, steps_left

log = logging.getLogger(__name__)

_PROGRESS = ("epoch", "cursor")
_SETTINGS = ("seed", "shuffle", "window", "global_batch_size", "drop_last", "samples", "index")


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < minimum:
        raise ValueError(f"SourceSampler: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def settings_changed(committed: dict, current: dict) -> str:
    """One line naming each setting ``committed`` holds with another value; "" if none."""
    changed = [f"{key} committed as {committed[key]!r}, now {current[key]!r}" for key in _SETTINGS
               if key in committed and committed[key] != current[key]]
    if not changed:
        return ""
    return ("SourceSampler settings differ from its committed state (construct it as committed: its cursor "
            f"counts positions of the committed order): {'; '.join(changed)}")


class SourceSampler(Sampler[list]):
    """This rank's share of each global batch of a ``ShardedSource`` (see the module doc).

    ``source``: a ``ShardedSource`` (or a list of shard sample counts). ``window``: how
    many positions are shuffled together (``order.py``); ``shuffle=False`` reads the
    shards in order, front to back.
    """

    def __init__(self, source: Any, global_batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 window: int = 8192, drop_last: bool = False):
        counts: Sequence[int] = getattr(source, "counts", source)
        self.counts = [_int("a shard's count", c, 0) for c in counts]
        index = getattr(source, "index", None)
        self.index_digest = index.digest if isinstance(index, ShardIndex) else counts_digest(self.counts)
        self.length = sum(self.counts)
        self.global_batch_size = _int("global_batch_size", global_batch_size, 1)
        self.order_settings = OrderSettings(int(seed), bool(shuffle), _int("window", window, 1))
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.cursor = 0
        # Until the runtime calls set_rank, this process is a world of one.
        self.rank = 0
        self.num_replicas = 1
        self._pass_start: Optional[int] = None
        self._order: Optional[EpochOrder] = None
        self._told_complete: Optional[int] = None

    # -- the world and the epoch -------------------------------------------------
    def set_rank(self, rank: int, num_replicas: int) -> None:
        """The new ring's layout; the next pass starts at the cursor."""
        num_replicas = _int("num_replicas", num_replicas, 1)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"SourceSampler: rank must be in [0, {num_replicas}), got {rank}")
        self.rank, self.num_replicas = int(rank), num_replicas
        self._pass_start = None

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first position; the current epoch keeps its cursor
        (the loop calls ``set_epoch(state.epoch)`` on every entry, mid-epoch too)."""
        epoch = _int("epoch", epoch, 0)
        if epoch != self.epoch:
            self.epoch, self.cursor = epoch, 0
        self._pass_start = None

    # -- progress ------------------------------------------------------------------
    def record_batch(self, batch_idx: int) -> None:
        """Global batch ``batch_idx`` of the current pass is trained (call it on every rank)."""
        batch_idx = _int("batch_idx", batch_idx, 0)
        start = self._current_start() + batch_idx * self.global_batch_size
        if start > self.cursor:
            raise ValueError(f"SourceSampler: record_batch({batch_idx}) before the batches of the pass ahead of it: "
                             f"the cursor is at {self.cursor}, batch {batch_idx} starts at {start}")
        bounds = batch_bounds(start, self.length, self.global_batch_size, self.drop_last)
        if bounds is not None:
            self.cursor = max(self.cursor, bounds[1])

    @property
    def processed_count(self) -> int:
        """Samples of the epoch trained (the cursor)."""
        return self.cursor

    @property
    def remaining_count(self) -> int:
        return self.length - self.cursor

    @property
    def loss_scale(self) -> float:
        """``W / g`` for the batch at the cursor (``g = G`` but for a smaller last one): a sum
        loss times it is the mean over the global batch (``elastic.global_batch``'s rule)."""
        bounds = batch_bounds(self.cursor, self.length, self.global_batch_size, self.drop_last)
        size = bounds[1] - bounds[0] if bounds is not None else self.global_batch_size
        return self.num_replicas / size

    # -- committed state ---------------------------------------------------------------
    def settings(self) -> dict:
        order = self.order_settings
        return {"seed": order.seed, "shuffle": order.shuffle, "window": order.window,
                "global_batch_size": self.global_batch_size, "drop_last": self.drop_last,
                "samples": self.length, "index": self.index_digest}

    def state_dict(self) -> dict:
        """The epoch, the cursor and the settings: plain values (committed every step)."""
        return {"epoch": self.epoch, "cursor": self.cursor, **self.settings()}

    def load_state_dict(self, state: dict) -> None:
        missing = [key for key in (*_PROGRESS, *_SETTINGS) if key not in state]
        if missing:
            raise ValueError(f"SourceSampler state lacks {missing}: got keys {sorted(state)}")
        changed = settings_changed(state, self.settings())
        if changed:
            raise ValueError(changed)
        cursor = _int("the committed cursor", state["cursor"], 0)
        if cursor > self.length:
            raise ValueError(f"SourceSampler: the committed cursor {cursor} is past the epoch's {self.length} samples")
        self.epoch = _int("the committed epoch", state["epoch"], 0)
        self.cursor = cursor
        self._pass_start = None

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[list]:
        # The pass starts now, not at the generator's first step: record_batch refers to it.
        self._pass_start = self.cursor
        return self._shares(self.cursor)

    def _shares(self, start: int) -> Iterator[list]:
        if start >= self.length and self.length and self._told_complete != self.epoch:
            self._told_complete = self.epoch
            log.warning("SourceSampler: epoch %d is complete: a pass yields nothing until set_epoch(%d)",
                        self.epoch, self.epoch + 1)
        order, world, rank = self.epoch_order(), self.num_replicas, self.rank
        for step in range(steps_left(start, self.length, self.global_batch_size, self.drop_last)):
            begin, end = batch_bounds(start + step * self.global_batch_size, self.length,
                                      self.global_batch_size, self.drop_last)
            ids = order.ids(begin, end)
            share = rank_share(begin, end, world, rank)
            yield ids[share.start - begin:share.stop - begin:share.step].tolist() if len(share) else []

    def __len__(self) -> int:
        start = self.cursor if self._pass_start is None else self._pass_start
        return steps_left(start, self.length, self.global_batch_size, self.drop_last)

    def epoch_order(self) -> EpochOrder:
        if self._order is None or self._order.epoch != self.epoch:
            self._order = EpochOrder(self.counts, self.order_settings, self.epoch)
        return self._order

    def _current_start(self) -> int:
        if self._pass_start is None:  # recorded without iterating: the pass starts at the cursor
            self._pass_start = self.cursor
        return self._pass_start
