"""Horovod's ``DistributedOptimizer`` on torch.distributed.

The gradients are all-reduced while the backward pass runs: a hook on every
parameter (``register_post_accumulate_grad_hook``) fires once its gradient has
been accumulated. torch matches collectives by issue order (Horovod by name), so
every rank must issue the same all-reduces in the same order whatever order its
hooks fire in, and even when a rank computed no gradient for some parameter. The
order is fixed at construction (``BucketPlan``): the parameters in reverse
registration order (about the order backward produces them), cut into buckets.
A hook only marks its parameter ready; the optimizer then starts the longest
prefix of buckets that are wholly ready. ``synchronize()`` starts the rest, with
zeros for gradients that never came, and waits for all of them.

The plan depends on the parameters alone, so it is the same on every rank and
needs no collective (a joiner builds the same one). Operations in flight when the
ring changes (a new round) are dropped, never waited for.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from . import basics
from .common import ADASUM_REFUSED, Adasum, Average, Compression, check_process_set, global_process_set
from .ops import finish_reduction_, start_flat_allreduce, translated_errors

FIRST_BUCKET_BYTES = 1 << 20  # small, so the first all-reduce starts early in the backward pass
BUCKET_BYTES = 25 << 20  # DDP's default bucket size; HOROVOD_FUSION_THRESHOLD (bytes) overrides it


def bucket_bytes(environ=os.environ) -> int:
    raw = environ.get("HOROVOD_FUSION_THRESHOLD")
    try:
        return max(1, int(raw)) if raw else BUCKET_BYTES
    except ValueError:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD={raw!r}: expected a number of bytes") from None

STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). "
    "This can cause training slowdown. You may want to consider using optimizer.skip_synchronize() context "
    "if you use optimizer.synchronize() in your code.")
ZERO_GRAD_PENDING = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally.")


@dataclass(frozen=True)
class BucketPlan:
    """Which parameters are all-reduced together, in the order every rank issues them."""

    buckets: tuple  # tuples of parameter indices (into the hooked parameters), in issue order

    @staticmethod
    def by_size(sizes: list, dtypes: list, first_bytes: int = FIRST_BUCKET_BYTES,
                bytes_per_bucket: int = BUCKET_BYTES) -> "BucketPlan":
        """Cut the parameters, in reverse registration order, into buckets of about
        ``bytes_per_bucket`` (the first one smaller), never mixing dtypes."""
        buckets, current, current_bytes, cap = [], [], 0, first_bytes
        for index in reversed(range(len(sizes))):
            if current and (current_bytes + sizes[index] > cap or dtypes[index] != dtypes[current[0]]):
                buckets.append(tuple(current))
                current, current_bytes, cap = [], 0, bytes_per_bucket
            current.append(index)
            current_bytes += sizes[index]
        if current:
            buckets.append(tuple(current))
        return BucketPlan(tuple(buckets))

    @staticmethod
    def by_groups(count: int, groups: list) -> "BucketPlan":
        """Explicit groups (lists of indices) each travel as one; every other parameter
        alone. Ordered by each bucket's last member in registration order, reversed."""
        grouped = {i for group in groups for i in group}
        buckets = [tuple(sorted(group, reverse=True)) for group in groups if group]
        buckets += [(i,) for i in range(count) if i not in grouped]
        return BucketPlan(tuple(sorted(buckets, key=lambda b: -max(b))))

    @staticmethod
    def split_evenly(count: int, parts: int) -> list:
        """``groups=N``: N groups of consecutive parameters of nearly equal length."""
        parts = max(1, min(parts, count))
        base, extra = divmod(count, parts)
        groups, start = [], 0
        for part in range(parts):
            length = base + (1 if part < extra else 0)
            groups.append(list(range(start, start + length)))
            start += length
        return groups


def _named(optimizer, named_parameters) -> dict:
    """Horovod's checks on ``named_parameters``; a name for every parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"allreduce.noname.{g}.{i}" for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])}
    named_parameters = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [name for name, _ in named_parameters]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}")
    by_param = {p: name for name, p in named_parameters}
    unnamed = [id(p) for p in params if p not in by_param]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         f"Python object ids: {', '.join(str(i) for i in unnamed)}")
    return by_param


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class (see DistributedOptimizer)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, original):
        super().__init__(params)
        self.defaults = dict(original.defaults)
        self._names = _named(self, named_parameters)
        self._compression = compression
        self._op = op
        self._prescale, self._postscale = 1.0, 1.0
        if op == Average and gradient_predivide_factor != 1.0:
            self._prescale, self._postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._hooked = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._index = {p: i for i, p in enumerate(self._hooked)}
        self._plan = self._make_plan(groups)
        self._bucket_of = {i: b for b, bucket in enumerate(self._plan.buckets) for i in bucket}
        self._flats = {}  # bucket index -> its flat buffer, reused every step
        self._should_synchronize = True
        self._synchronized = False
        self.set_backward_passes_per_step(backward_passes_per_step)
        for p in self._hooked:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _make_plan(self, groups) -> BucketPlan:
        count = len(self._hooked)
        if groups is None:
            cap = bucket_bytes()
            return BucketPlan.by_size([p.numel() * p.element_size() for p in self._hooked],
                                      [p.dtype for p in self._hooked], min(FIRST_BUCKET_BYTES, cap), cap)
        if isinstance(groups, int):
            return BucketPlan.by_groups(count, BucketPlan.split_evenly(count, groups))
        if not isinstance(groups, list) or any(not isinstance(g, list) for g in groups):
            raise ValueError("groups should be a non-negative integer or a list of lists of parameters")
        indices = []
        for group in groups:
            if any(p not in self._index for p in group):
                raise ValueError("groups: every parameter must be one of the optimizer's, with requires_grad")
            indices.append([self._index[p] for p in group])
        return BucketPlan.by_groups(count, indices)

    # -- per-step bookkeeping ------------------------------------------------------
    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        self._reset_step()

    def _reset_step(self) -> None:
        self._delay = [self.backward_passes_per_step] * len(self._hooked)
        self._ready_in_bucket = [0] * len(self._plan.buckets)
        self._ready = [False] * len(self._hooked)
        self._next_bucket = 0
        self._in_flight = []  # (work, ring size, flat buffer, params, compressed) in issue order
        self._touched = False  # a hook fired since the last synchronize
        self._round = self._current_round()

    @staticmethod
    def _current_round() -> Optional[int]:
        try:
            return basics.session().round
        except Exception:  # not initialized yet: nothing in flight either
            return None

    def _follow_the_ring(self) -> None:
        """Work started on a ring that is gone is dropped with its buffers."""
        if self._touched and self._current_round() != self._round:
            self._flats = {}
            self._reset_step()

    def _gradient_ready(self, p: torch.Tensor) -> None:
        self._follow_the_ring()
        if not self._touched:
            self._round = self._current_round()
        self._touched = True
        index = self._index[p]
        if self._delay[index] <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        self._delay[index] -= 1
        if self._delay[index] == 0:
            self._mark_ready(index)
            self._start_ready_buckets()

    def _mark_ready(self, index: int) -> None:
        self._ready[index] = True
        self._ready_in_bucket[self._bucket_of[index]] += 1

    def _start_ready_buckets(self) -> None:
        buckets = self._plan.buckets
        while self._next_bucket < len(buckets) and \
                self._ready_in_bucket[self._next_bucket] == len(buckets[self._next_bucket]):
            self._start_bucket(self._next_bucket)
            self._next_bucket += 1

    def _start_bucket(self, bucket_index: int) -> None:
        params = [self._hooked[i] for i in self._plan.buckets[bucket_index]]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()  # travels dense (sparse_as_dense or not)
        compressed = [self._compression.compress(p.grad) for p in params]
        if len(compressed) == 1 and compressed[0][0].is_contiguous():
            flat = compressed[0][0]
        else:
            # One flat buffer per bucket, kept across steps (a fresh one per step
            # costs page faults comparable to the copy itself).
            total = sum(c.numel() for c, _ in compressed)
            flat = self._flats.get(bucket_index)
            if flat is None or flat.numel() != total or flat.dtype != compressed[0][0].dtype \
                    or flat.device != compressed[0][0].device:
                flat = self._flats[bucket_index] = compressed[0][0].new_empty(total)
            torch.cat([c.reshape(-1) for c, _ in compressed], out=flat)
        work, size = start_flat_allreduce(flat, self._op, self._prescale)
        self._in_flight.append((work, size, flat, params, compressed))

    def _finish_bucket(self, work, size, flat, params, compressed) -> None:
        with translated_errors():
            work.wait()
        finish_reduction_(flat, self._op, self._postscale, size)
        offset = 0
        with torch.no_grad():
            for p, (c, ctx) in zip(params, compressed):
                if flat is c:
                    reduced = c
                else:
                    reduced = flat[offset:offset + c.numel()].view_as(c)
                    offset += c.numel()
                result = self._compression.decompress(reduced, ctx)
                if result.data_ptr() != p.grad.data_ptr():
                    p.grad.copy_(result.view_as(p.grad))

    # -- the Horovod interface -----------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient all-reduce of this step (zeros for missing gradients)."""
        self._follow_the_ring()
        if not self._touched:
            self._round = self._current_round()
        for index, ready in enumerate(self._ready):
            if not ready:
                self._mark_ready(index)
        self._start_ready_buckets()
        in_flight, self._in_flight = self._in_flight, []
        for started in in_flight:
            self._finish_bucket(*started)
        self._reset_step()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside it does not synchronize (after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(STEP_AFTER_SYNCHRONIZE)
            self.synchronize()
        self._synchronized = False
        return self.wrapped_step(closure)

    def wrapped_step(self, closure=None):
        """The wrapped class's own step, without any all-reduce."""
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        self._follow_the_ring()
        if self._touched:
            raise AssertionError(ZERO_GRAD_PENDING)
        return super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict):
        # An elastic restore may come in the middle of a step: forget its all-reduces.
        self._reset_step()
        self._synchronized = False
        return super().load_state_dict(state_dict)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,  # noqa: N802
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=global_process_set):
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over every rank.

    The result is an instance of a subclass of the optimizer's own class (LR
    schedulers and ``isinstance`` keep working), built on its param groups; the
    original optimizer's state is not carried over (as in Horovod)."""
    check_process_set(process_set)
    if op == Adasum:
        raise NotImplementedError(ADASUM_REFUSED)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of lists of parameters")
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": __name__})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, optimizer)
