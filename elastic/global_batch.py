"""Constant global batch: the same sequence of global batches at any world size.

``ElasticSampler.batches(global_batch_size=G)`` fixes the batch of the *job*, not of
a rank, so a run that loses and gains workers follows the trajectory of a run that
never did.

Layout of one pass
------------------
``R`` is the pass's index list (the epoch's permutation minus what is processed,
frozen when the pass starts; see ``elastic.sampler``). With ``W`` ranks:

* global batch ``k`` is ``R[k*G:(k+1)*G]``. Because the processed indices of an
  epoch are the first ``k*G`` of its permutation after ``k`` recorded steps, a new
  world that resumes from a commit continues the very same sequence of global
  batches; no batch depends on ``W``;
* rank ``r``'s share of a global batch ``b`` is ``b[r::W]``: ``ceil(len(b)/W)``
  samples for ranks ``r < len(b) % W``, ``floor(len(b)/W)`` for the others;
* every rank yields one share per global batch, so the step counts are equal.

The last global batch of an epoch holds what is left, ``g = N % G`` samples when
``G`` does not divide the epoch's ``N``; it is split the same way. When ``g < W``
the ranks ``r >= g`` get an *empty* share and must still run the step (a forward
on zero rows gives a zero sum loss and a zero gradient, and DDP's all-reduce needs
every rank); ``DataLoader``'s default collate cannot build an empty batch, so index
the data directly (``dataset[rows]`` for a ``TensorDataset``). With
``drop_last=True`` a last batch smaller than ``G`` is not yielded (its samples stay
unprocessed for the epoch), as ``DataLoader(drop_last=True)`` does in one process.

Micro-batches
-------------
With ``micro_batch_size=M`` each step yields this rank's share as a list of
micro-batches: ``n = max(1, ceil(ceil(len(b)/W) / M))`` of them on *every* rank
(the same count everywhere, so collectives that DDP runs per forward stay
matched), the share cut into ``n`` contiguous pieces whose sizes differ by at most
one (so none exceeds ``M``; a piece is empty only if the share has fewer than
``n`` samples). ``accumulate(ddp, micro_batches)`` runs all but the last under
``ddp.no_sync()``, so the gradients of the step are all-reduced once.

The loss rule
-------------
``loss_fn(out, target, reduction="sum") * sampler.loss_scale`` with
``loss_scale = W / len(b)``: DDP averages the ranks' gradients, so the step's
gradient is ``(1/W) * sum_r (W/len(b)) * sum_{i in share_r} grad l_i``, the mean
over the global batch, whatever the shares' sizes and however they are cut into
micro-batches. Only floating-point summation order depends on ``W``.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Iterable, Iterator, Protocol, TypeVar

from torch.utils.data import Sampler

T = TypeVar("T")


def non_negative_int(name: str, value, minimum: int = 0) -> int:
    """``value`` as an int (numpy and torch integers too), or a one-line ValueError."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def positive_int(name: str, value) -> int:
    return non_negative_int(name, value, minimum=1)


def global_batch_count(pass_len: int, global_batch_size: int, drop_last: bool) -> int:
    """Number of global batches (steps) in a pass of ``pass_len`` indices."""
    full, rest = divmod(pass_len, global_batch_size)
    return full + (1 if rest and not drop_last else 0)


def global_batch_bounds(pass_len: int, global_batch_size: int, batch_idx: int) -> tuple[int, int]:
    """[start, end) of global batch ``batch_idx`` within a pass of ``pass_len`` indices."""
    start = min(batch_idx * global_batch_size, pass_len)
    return start, min(start + global_batch_size, pass_len)


def rank_share(batch: list[int], world: int, rank: int) -> list[int]:
    """Rank ``rank``'s part of a global batch: sizes differ by at most one between ranks."""
    return batch[rank::world]


def micro_batch_count(batch_len: int, world: int, micro_batch_size: int) -> int:
    """Micro-batches per step on every rank: enough for the largest share."""
    largest_share = -(-batch_len // world)
    return max(1, -(-largest_share // micro_batch_size))


def split_evenly(share: list[int], pieces: int) -> list[list[int]]:
    """``share`` cut into ``pieces`` contiguous runs whose sizes differ by at most one."""
    size, extra = divmod(len(share), pieces)
    out, start = [], 0
    for piece in range(pieces):
        end = start + size + (1 if piece < extra else 0)
        out.append(share[start:end])
        start = end
    return out


class PassSource(Protocol):
    """What a global batch layout needs of its sampler (``ElasticSampler`` is one)."""

    num_replicas: int
    rank: int
    drop_last: bool

    def start_pass(self) -> list[int]: ...

    def current_pass(self) -> list[int]: ...


class GlobalBatchSampler(Sampler[list]):
    """This rank's share of each global batch of a pass (see the module doc).

    Yields ``list[int]`` per step, or with ``micro_batch_size`` a ``list[list[int]]``
    of micro-batches per step.
    """

    def __init__(self, sampler: PassSource, global_batch_size: int, micro_batch_size: int | None = None):
        self.sampler = sampler
        self.global_batch_size = positive_int("global_batch_size", global_batch_size)
        self.micro_batch_size = None if micro_batch_size is None else positive_int("micro_batch_size", micro_batch_size)

    def __iter__(self) -> Iterator[list]:
        sampler = self.sampler
        pass_indices, world, rank = sampler.start_pass(), sampler.num_replicas, sampler.rank
        for batch_idx in range(global_batch_count(len(pass_indices), self.global_batch_size, sampler.drop_last)):
            start, end = global_batch_bounds(len(pass_indices), self.global_batch_size, batch_idx)
            share = rank_share(pass_indices[start:end], world, rank)
            if self.micro_batch_size is None:
                yield share
            else:
                yield split_evenly(share, micro_batch_count(end - start, world, self.micro_batch_size))

    def __len__(self) -> int:
        return global_batch_count(len(self.sampler.current_pass()), self.global_batch_size, self.sampler.drop_last)


def accumulate(model, micro_batches: Iterable[T]) -> Iterator[T]:
    """Yield the micro-batches of one step; all but the last inside ``model.no_sync()``.

    Run the forward and backward of each yielded micro-batch in the loop body:

        for rows in elastic.accumulate(ddp, micro_batches):
            loss = F.cross_entropy(ddp(x[rows]), y[rows], reduction="sum") * sampler.loss_scale
            loss.backward()
        optimizer.step()

    Gradients add up locally until the last micro-batch, whose backward all-reduces
    the sum once. A model without ``no_sync`` (no DDP: a world of one) just gets
    every micro-batch.
    """
    items = list(micro_batches)
    no_sync = getattr(model, "no_sync", None)
    for item in items[:-1]:
        with no_sync() if no_sync is not None else contextlib.nullcontext():
            yield item
    if items:
        yield items[-1]
