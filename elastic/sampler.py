"""ElasticSampler: each sample of an epoch is seen exactly once, across resizes.

The sampler is part of the committed state. Its state is the epoch and the set of
indices already processed (by every rank) in that epoch; the permutation itself is
derived from ``seed + epoch`` and never stored. Because every global batch is a
contiguous run of the remaining permutation, the processed set is (almost always) a
prefix of the permutation: the state stores that prefix's length plus the few
indices processed out of order, so a commit every step costs O(1), not O(dataset).

Layout of one pass
------------------
A *pass* starts when the sampler is iterated (and after ``set_epoch``,
``set_rank`` or ``load_state_dict``). Its index list ``R`` is the epoch's
permutation minus the processed indices, in permutation order, frozen for the
pass (later ``record_batch`` calls refer to it). With ``W`` ranks and batch
size ``B``:

* rank ``r`` yields the strided share ``R[r::W]`` (shares differ by at most one
  sample and are disjoint, so nothing is duplicated and nothing is dropped);
* a ``DataLoader(batch_size=B)`` over that share gives, on every rank, batch
  ``k`` = the strided slice of the *global batch* ``R[k*W*B:(k+1)*W*B]``;
* so ``record_batch(k, B)``, called on every rank after the synchronous step,
  marks the whole global batch ``k`` processed without any communication.

Equal step counts (what DDP needs)
----------------------------------
Every rank gets ``ceil(len(share) / B)`` batches; that is the same on every rank
unless the last global batch holds fewer than ``W`` samples (then some ranks have
one more batch than others, and a DDP loop would hang). Two ways out, both keep
exactly-once:

* ``DataLoader(dataset, batch_sampler=sampler.batches(B))`` - the same layout,
  except that such a short final remainder is folded into the previous global
  batch (some ranks' last batch then has ``B + 1`` samples). Every rank gets the
  same number of batches whenever at least ``W`` samples remain.
* ``drop_last=True`` - the pass is truncated to a multiple of ``W`` (at most
  ``W - 1`` samples of the epoch are not seen; they are not marked processed).

The one case no layout can serve is fewer remaining samples than ranks (a world
that grew at the very end of an epoch): ``batches()`` then yields nothing and
those samples are skipped for this epoch, with a warning.

Iterating again within an epoch yields only what was not recorded yet, so once an
epoch is complete a pass is empty until ``set_epoch`` starts the next one (said
once per epoch in the log). Horovod's sampler repeats its last list instead; that is
``elastic.horovod``'s behaviour, not this one's: repeating here would train samples
of an epoch twice under the same epoch number, which is what this sampler exists to
prevent (a loop that breaks out of the loader mid-epoch and iterates again would
repeat the epoch's beginning).

Settings and data sets
----------------------
``seed``, ``shuffle`` and ``drop_last`` are part of the state: the processed set is
kept as a prefix of the permutation they make, so a resume with other values (a
changed default in the script) would mark other samples processed than those that
were trained. ``load_state_dict`` refuses it in one line naming the field; a state
committed before these fields existed still loads. A data set without a length (an
``IterableDataset``) has no indices to sample: shards go through ``elastic.ShardedSource``
and its ``SourceSampler``, an opaque stream through ``elastic.StatefulStream``
(``elastic/data/``).

Constant global batch
---------------------
``batches(global_batch_size=G)`` fixes the batch of the job instead: each step's
global batch is the next ``G`` samples of ``R`` at any world size, shares are
uneven when ``W`` does not divide ``G``, ``loss_scale`` (``W / G``) makes a sum
loss the mean over the global batch, and ``record_batch(batch_idx)`` needs no
size. The layout, the last smaller batch and micro-batches are described in
``elastic.global_batch``.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Sized

import torch
from torch.utils.data import IterableDataset, Sampler

from .global_batch import GlobalBatchSampler, global_batch_bounds, non_negative_int, positive_int

logger = logging.getLogger(__name__)

_STATE_KEYS = ("epoch", "length", "prefix", "processed")
# Committed with the progress; absent from states committed before they were (those load).
_SETTINGS = ("seed", "shuffle", "drop_last")


class ElasticSampler(Sampler[int]):
    """A distributed sampler whose progress survives re-formations of the world."""

    def __init__(
        self,
        dataset_or_len: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        length = _length_of(dataset_or_len)
        self.length = length
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        # Until the runtime calls set_rank, this process is a world of one.
        self.rank = 0
        self.num_replicas = 1
        self._processed: set[int] = set()
        self._prefix = 0  # permutation[:_prefix] is processed
        self._extra: set[int] = set()  # processed, but beyond that prefix
        self._permutation: list[int] | None = None
        self._pass: list[int] | None = None  # R of the current pass (see module doc)
        # Set by batches(): G in the constant-global-batch mode, None for per-rank batches.
        self.global_batch_size: int | None = None
        self._told_complete: int | None = None  # the epoch whose empty pass was logged

    # -- epoch and world -------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: new permutation, empty processed set.

        Calling it again with the current epoch keeps the progress: the intended user
        loop calls ``set_epoch(state.epoch)`` every time ``train`` is re-entered after
        a re-formation, mid-epoch.
        """
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self._permutation = None
            self._clear_progress()
        self._pass = None

    def set_rank(self, rank: int, num_replicas: int) -> None:
        """Re-partition the epoch's remaining indices among a new world."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.rank = int(rank)
        self.num_replicas = int(num_replicas)
        self._pass = None

    # -- progress --------------------------------------------------------------------

    def record_batch(self, batch_idx: int, batch_size: int | None = None) -> None:
        """Mark global batch ``batch_idx`` of the current pass processed (on every rank).

        Call it on every rank after the synchronous step of the loader's batch
        ``batch_idx`` (its index within the current iteration). With per-rank
        batches (``batches(B)`` or a ``DataLoader(batch_size=B)``) pass ``B``; after
        ``batches(global_batch_size=G)`` the size is not needed: the whole global
        batch ``batch_idx`` (``G`` samples, or the smaller last one) is marked.
        """
        batch_idx = non_negative_int("batch_idx", batch_idx)
        pass_indices = self.current_pass()
        if self.global_batch_size is not None:
            if batch_size is not None and batch_size != self.global_batch_size:
                raise ValueError(f"record_batch got batch_size {batch_size}, but the sampler yields global "
                                 f"batches of {self.global_batch_size}: call record_batch(batch_idx)")
            start, end = global_batch_bounds(len(pass_indices), self.global_batch_size, batch_idx)
        else:
            if batch_size is None:
                raise ValueError("record_batch needs the per-rank batch_size (or use batches(global_batch_size=G))")
            batch_size = positive_int("batch_size", batch_size)
            start, end = _global_batch_bounds(len(pass_indices), self.num_replicas, batch_size, batch_idx)
        self._mark(pass_indices[start:end])

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark specific global dataset indices processed (an alternative to record_batch)."""
        indices = [int(i) for i in indices]
        for index in indices:
            if not 0 <= index < self.length:
                raise ValueError(f"index {index} is outside the dataset (length {self.length})")
        self._mark(indices)

    @property
    def processed_count(self) -> int:
        return len(self._processed)

    @property
    def remaining_count(self) -> int:
        return self.length - len(self._processed)

    @property
    def loss_scale(self) -> float:
        """``W / G``: multiply a *sum* loss by it to get the mean over the global batch.

        ``loss_fn(output, target, reduction="sum") * sampler.loss_scale``: DDP divides
        the all-reduced gradient by ``W``, so the step's gradient is the mean-loss
        gradient over the ``G`` samples of the global batch, even when the ranks'
        shares differ in size (``W`` does not divide ``G``) or are cut into
        micro-batches. For the last, smaller global batch of an epoch (``g < G``
        samples) it is ``W / g``: that step is the mean over its own ``g`` samples,
        as a single process's last, short DataLoader batch with a mean loss is.

        The current global batch is the next one to be recorded (``record_batch``
        after each step), so read it between the step's start and its
        ``record_batch``. Only defined after ``batches(global_batch_size=G)``.
        """
        if self.global_batch_size is None:
            raise ValueError("loss_scale is defined for global batches: call batches(global_batch_size=G) first")
        current = min(self.global_batch_size, self.remaining_count)
        if current == 0 or (self.drop_last and current < self.global_batch_size):
            current = self.global_batch_size  # no (short) batch left to run
        return self.num_replicas / current

    # -- committed state -------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain python values (JSON-able): committed and broadcast by the runtime.

        ``prefix``: the first ``prefix`` indices of the epoch's permutation are
        processed; ``processed``: the other processed indices (usually none).
        """
        return {"epoch": self.epoch, "length": self.length, "prefix": self._prefix,
                "processed": sorted(self._extra), **self.settings()}

    def settings(self) -> dict:
        """What the epoch's permutation and passes are made of: committed with the progress."""
        return {"seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, sd: dict) -> None:
        missing = [key for key in _STATE_KEYS if key not in sd]
        if missing:
            raise ValueError(f"sampler state lacks {missing}: got keys {sorted(sd)}")
        if int(sd["length"]) != self.length:
            raise ValueError(f"sampler state is for a data set of {sd['length']} samples, this one has {self.length}")
        changed = settings_changed(sd, self.settings())
        if changed:
            raise ValueError(changed)
        prefix = int(sd["prefix"])
        if not 0 <= prefix <= self.length:
            raise ValueError(f"sampler state prefix {prefix} is outside [0, {self.length}]")
        epoch = int(sd["epoch"])
        if epoch != self.epoch:
            self._permutation = None
        self.epoch = epoch
        self._clear_progress()
        self._mark(self._epoch_permutation()[:prefix])
        self.record_indices(sd["processed"])
        self._pass = None

    # -- iteration -------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        return iter(self.start_pass()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return len(self.current_pass()[self.rank :: self.num_replicas])

    # -- passes (what the batch samplers lay out) ---------------------------------------

    def start_pass(self) -> list[int]:
        """Begin a pass: freeze ``R``, the epoch's remaining indices in order (module doc)."""
        self._pass = self._remaining()
        if not self._pass and self.remaining_count == 0 and self.length and self._told_complete != self.epoch:
            self._told_complete = self.epoch
            logger.warning("sampler: epoch %d is complete: a pass yields nothing until set_epoch(%d)",
                           self.epoch, self.epoch + 1)
        return self._pass

    def current_pass(self) -> list[int]:
        """``R`` of the pass under way (begun now if none is)."""
        if self._pass is None:
            self._pass = self._remaining()
        return self._pass

    def batches(
        self, batch_size: int | None = None, *, global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
    ) -> "ElasticBatchSampler | GlobalBatchSampler":
        """A batch sampler with the same number of batches on every rank.

        ``batches(B)``: ``B`` samples per rank and step (see the module doc).
        ``batches(global_batch_size=G)``: ``G`` samples per step over the whole world,
        at any world size; with ``micro_batch_size=M`` each step is this rank's share
        as a list of micro-batches of at most ``M`` (see ``elastic.global_batch``).
        """
        if (batch_size is None) == (global_batch_size is None):
            raise ValueError("batches() takes either a per-rank batch_size or a global_batch_size")
        if global_batch_size is None:
            if micro_batch_size is not None:
                raise ValueError("micro_batch_size needs global_batch_size")
            self.global_batch_size = None
            return ElasticBatchSampler(self, batch_size)
        sampler = GlobalBatchSampler(self, global_batch_size, micro_batch_size)
        self.global_batch_size = sampler.global_batch_size
        return sampler

    # -- internals -------------------------------------------------------------------

    def _epoch_permutation(self) -> list[int]:
        if self._permutation is None:
            if self.shuffle:
                generator = torch.Generator()
                generator.manual_seed(self.seed + self.epoch)
                self._permutation = torch.randperm(self.length, generator=generator).tolist()
            else:
                self._permutation = list(range(self.length))
        return self._permutation

    def _clear_progress(self) -> None:
        self._processed, self._extra, self._prefix = set(), set(), 0

    def _mark(self, indices: Iterable[int]) -> None:
        for index in indices:
            if index not in self._processed:
                self._processed.add(index)
                self._extra.add(index)
        # Advance the prefix (amortised O(1) per index over an epoch).
        permutation = self._epoch_permutation()
        while self._prefix < self.length and permutation[self._prefix] in self._processed:
            self._extra.discard(permutation[self._prefix])
            self._prefix += 1

    def _remaining(self) -> list[int]:
        remaining = [i for i in self._epoch_permutation() if i not in self._processed]
        # Global batches drop only a short last global batch (elastic.global_batch).
        if self.drop_last and self.global_batch_size is None:
            remaining = remaining[: len(remaining) - len(remaining) % self.num_replicas]
        return remaining


def _length_of(dataset_or_len) -> int:
    """The number of samples; a stream (no ``__len__``) is refused with what to do instead."""
    if isinstance(dataset_or_len, IterableDataset) or (
            not isinstance(dataset_or_len, int) and not hasattr(dataset_or_len, "__len__")):
        raise TypeError(
            f"ElasticSampler needs a data set with a length (a map-style Dataset), got "
            f"{type(dataset_or_len).__name__}: read shards through elastic.ShardedSource (resumes at any world "
            f"size), or shard a stream yourself by elastic.rank() and elastic.size() and commit it as "
            f"elastic.StatefulStream (resumes at the same world size)")
    length = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"ElasticSampler needs a dataset or a length >= 0, got {dataset_or_len!r}")
    return length


def settings_changed(committed: dict, current: dict) -> str:
    """One line naming each setting that ``committed`` (a sampler state) holds with another
    value than ``current``; "" if none differs or the state predates the settings."""
    changed = [f"{key} committed as {committed[key]!r}, now {current[key]!r}" for key in _SETTINGS
               if key in committed and committed[key] != current[key]]
    if not changed:
        return ""
    # The advice first: a summary cut at its 300th character loses at most the end of a value.
    return (f"sampler settings differ from its committed state (construct it as committed, or its progress "
            f"would mark other samples processed than those trained): {'; '.join(changed)}")


class ElasticBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of a pass; equal batch counts on every rank."""

    def __init__(self, sampler: ElasticSampler, batch_size: int) -> None:
        self.sampler = sampler
        self.batch_size = positive_int("batch_size", batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        sampler = self.sampler
        pass_indices, world = sampler.start_pass(), sampler.num_replicas
        if 0 < len(pass_indices) < world:
            logger.warning(
                "sampler: %d remaining samples for %d ranks; skipping them this epoch",
                len(pass_indices), world,
            )
        for batch_idx in range(self._count(len(pass_indices))):
            start, end = _global_batch_bounds(len(pass_indices), world, self.batch_size, batch_idx)
            yield pass_indices[start:end][sampler.rank :: world]

    def __len__(self) -> int:
        return self._count(len(self.sampler.current_pass()))

    def _count(self, pass_len: int) -> int:
        world, per_step = self.sampler.num_replicas, self.sampler.num_replicas * self.batch_size
        if pass_len < world:
            return 0
        full, rest = divmod(pass_len, per_step)
        # A remainder shorter than the world is folded into the last full batch.
        return full + (1 if rest >= world else 0)


def _global_batch_bounds(pass_len: int, world: int, batch_size: int, batch_idx: int) -> tuple[int, int]:
    """[start, end) of global batch ``batch_idx`` within a pass of ``pass_len`` indices.

    Global batch k is R[k*W*B : (k+1)*W*B]; when what would follow it is a remainder
    shorter than W (which not every rank could take a sample of), it is folded into
    batch k, so that batches() and record_batch agree on where the pass ends.
    """
    per_step = world * batch_size
    start = min(batch_idx * per_step, pass_len)
    end = min(start + per_step, pass_len)
    if pass_len - end < world:
        end = pass_len
    return start, end
