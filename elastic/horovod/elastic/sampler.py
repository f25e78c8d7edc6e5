"""``hvd.elastic.ElasticSampler``: Horovod's sampler interface on the exactly-once sampler.

Horovod's ``ElasticSampler(dataset, shuffle=True, seed=0)`` is used as

    sampler = hvd.elastic.ElasticSampler(dataset)
    loader = DataLoader(dataset, batch_size=B, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, ...)
    for idx, batch in enumerate(loader):
        ...                                   # one synchronous step
        state.train_sampler.record_batch(idx, B)
        state.commit()
    state.train_sampler.set_epoch(epoch + 1)  # at the END of an epoch

This class keeps that interface, Horovod's repeat and Horovod's layout of a pass (the
epoch's remaining indices, padded by wrap-around to a multiple of the world size so
that every rank gets the same number of samples, rank r taking every W-th from r), on
top of ``elastic.ElasticSampler``: the progress is the set of indices processed by the
whole world (global, part of the committed state), and after every re-formation the
remaining indices are partitioned afresh among the new world.

The repeat, as Horovod's own test defines it: a pass is the epoch's remaining indices
as of the last reset (``set_epoch``, ``load_state_dict``, a re-formation), and every
iteration of the loader yields that same pass again until the next reset; so after
an epoch ends, a loop that iterates again without ``set_epoch`` trains the epoch's
pass once more (``elastic.ElasticSampler`` yields nothing there: see its module doc).
Each iteration's ``record_batch`` calls count from the pass's start, and marking a
sample processed twice counts it once, so the progress stays the set of samples
trained. What differs from Horovod, on purpose:

* ``record_batch(batch_idx, batch_size)`` marks the next ``batch_size * W`` positions
  of the current pass processed (``batch_idx`` is ignored, as Horovod ignores it), so
  progress is a set of real indices, not a count: the wrap-around padding is never
  counted twice, and ``processed_num`` is the number of distinct samples processed.
* After a re-formation nothing is repeated: Horovod re-partitions only when it syncs
  and skips the sync after a removal (its issue 3399: repeated samples); here every
  re-formation syncs and re-partitions from the committed progress.
* ``set_epoch(e)`` with the sampler's current epoch keeps the epoch's progress (a
  script that calls it at an epoch's start would otherwise repeat the epoch after a
  reset); with another epoch it starts that epoch afresh, as Horovod's does.
* The permutation is ``torch.randperm`` seeded with ``seed + epoch`` (Horovod uses
  ``random.Random``), so the order differs from Horovod's for the same seed.
"""

from __future__ import annotations

import math
from typing import Iterator

from ...contract.errors import ElasticError
from ...sampler import ElasticSampler as _ExactlyOnceSampler
from .. import basics


class ElasticSampler(_ExactlyOnceSampler):
    """Horovod's ``ElasticSampler``: partitions a data set, re-partitions after a reset."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(dataset, shuffle=shuffle, seed=seed)
        self.dataset = dataset
        self._recorded_pass = None  # the pass that _recorded counts positions of
        self._recorded = 0  # positions of that pass recorded so far
        try:  # Horovod partitions at construction (hvd.init() came first)
            position = basics.session().position
        except ElasticError:
            return  # a world of one until a TorchState's re-formation partitions it
        self.set_rank(position.rank, position.world_size)

    # -- Horovod's names -------------------------------------------------------------
    @property
    def processed_num(self) -> int:
        """Distinct samples of the current epoch processed by the whole world."""
        return self.processed_count

    @property
    def num_samples(self) -> int:
        return len(self)

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """The next ``batch_size`` samples of every rank have been processed (by the
        synchronous step that just ended). ``batch_idx`` is ignored, as in Horovod."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"record_batch needs a batch_size >= 1, got {batch_size!r}")
        pass_indices = self._pass_with_cursor()
        start = self._recorded
        end = start + batch_size * self.num_replicas
        self._recorded = end
        # Positions past the pass are the wrap-around padding: already marked.
        self.record_indices(pass_indices[start:min(end, len(pass_indices))])

    def load_state_dict(self, sd: dict) -> None:
        """This sampler's own state (``state_dict()``), or Horovod's ``{epoch, processed_num}``."""
        if set(sd) == {"epoch", "processed_num"}:
            epoch, processed = int(sd["epoch"]), int(sd["processed_num"])
            self.set_epoch(epoch)
            self.load_state_dict({"epoch": epoch, "length": self.length, "prefix": min(processed, self.length),
                                  "processed": []})
            return
        super().load_state_dict(sd)

    # -- the pass: Horovod's padded, strided layout ---------------------------------------
    def __iter__(self) -> Iterator[int]:
        pass_indices = self.start_pass()
        return iter(_padded(pass_indices, self.num_replicas)[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return math.ceil(len(self.current_pass()) / self.num_replicas)

    def start_pass(self) -> list[int]:
        """An iteration begins: the pass since the last reset, again (Horovod's repeat)."""
        pass_indices = self.current_pass()
        self._recorded_pass, self._recorded = pass_indices, 0
        return pass_indices

    def _pass_with_cursor(self) -> list[int]:
        pass_indices = self.current_pass()
        if pass_indices is not self._recorded_pass:  # a new pass began: nothing of it recorded
            self._recorded_pass, self._recorded = pass_indices, 0
        return pass_indices


def _padded(indices: list[int], world: int) -> list[int]:
    """``indices`` padded by wrap-around to a multiple of ``world`` (Horovod's layout)."""
    if not indices:
        return []
    total = math.ceil(len(indices) / world) * world
    padded = list(indices)
    while len(padded) < total:
        padded.extend(indices[: total - len(padded)])
    return padded
