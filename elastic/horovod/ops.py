"""Horovod's all-reduce family on torch.distributed: handles, ops, scale factors.

Every call looks the ring up anew (the default process group): under elastic-run
it is replaced at every re-formation, so nothing here holds on to a group.
gloo has no AVG: Average is a SUM followed by a division by the ring's size
(truncating for integers, as Horovod does). A collective that fails because the
ring broke raises ``HorovodInternalError``.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..worker.failures import classify
from . import basics
from .common import ADASUM_REFUSED, Adasum, Average, Compression, HorovodInternalError, Max, Min, Product, Sum
from .common import OP_NAMES, check_process_set, global_process_set

_TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


@dataclass
class Pending:
    """An operation under way: the works to wait for, then what turns them into the output."""

    works: list
    finish: Callable[[], Any]
    keep: list = field(default_factory=list)  # inputs that must outlive the operation


_handles: dict[int, Pending] = {}
_handle_numbers = itertools.count(1)


def issue(pending: Pending) -> int:
    number = next(_handle_numbers)
    _handles[number] = pending
    return number


def forget_handles() -> None:
    """Drop every operation of a ring that broke (their buffers would stay alive)."""
    _handles.clear()


def poll(handle: int) -> bool:
    """Has the operation finished (so ``synchronize`` would not block)?"""
    pending = _handles.get(handle)
    if pending is None:
        return True
    with translated_errors():
        return all(work.is_completed() for work in pending.works)


def synchronize(handle: int):
    """Wait for the operation and return its output (None for an unknown handle)."""
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    return wait(pending)


def wait(pending: Pending):
    with translated_errors():
        for work in pending.works:
            work.wait()
    return pending.finish()


@contextlib.contextmanager
def translated_errors():
    """A failure of the ring becomes HorovodInternalError (the cause stays chained)."""
    basics.collective_outside_run()
    try:
        yield
    except HorovodInternalError:
        forget_handles()
        raise
    except RuntimeError as exc:
        fault = classify(exc)
        if not fault.reforms:
            raise
        forget_handles()
        raise HorovodInternalError(fault.reason) from exc


def ring_size() -> int:
    basics.require_initialized()
    return dist.get_world_size()


def resolve_op(op, average, default=Average):
    """Horovod's rule for the deprecated ``average=`` flag against ``op=``."""
    if average is not None:
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return default if op is None else op


def torch_op(op):
    if op == Adasum:
        raise NotImplementedError(ADASUM_REFUSED)
    if op not in _TORCH_OPS:
        raise ValueError(f"unknown reduction op {op!r} (use one of {', '.join(OP_NAMES.values())})")
    return _TORCH_OPS[op]


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiply in place; integer tensors are scaled in float64 and truncated back."""
    if factor == 1.0:
        return
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.mul_(factor)
    else:
        tensor.copy_(tensor.to(torch.float64).mul_(factor).to(tensor.dtype))


def divide_(tensor: torch.Tensor, divisor: int) -> None:
    if divisor == 1:
        return
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.div_(divisor)
    else:
        tensor.copy_(torch.div(tensor, divisor, rounding_mode="trunc"))


def _check_dense(tensor: torch.Tensor) -> None:
    if tensor.is_sparse:
        raise ValueError("sparse tensors: use DistributedOptimizer(sparse_as_dense=True) or densify first")


def finish_reduction_(flat: torch.Tensor, op, postscale_factor: float, size: int) -> None:
    """After the SUM: Average's division and the postscale, in one pass for floats."""
    if op == Average and (flat.dtype.is_floating_point or flat.dtype.is_complex):
        flat.mul_(postscale_factor / size)
        return
    if op == Average:
        divide_(flat, size)
    scale_(flat, postscale_factor)


def start_flat_allreduce(flat: torch.Tensor, op, prescale_factor: float = 1.0):
    """Start the all-reduce of one contiguous tensor in place; returns (work, ring size)."""
    reduce_op = torch_op(op)
    size = ring_size()
    _check_dense(flat)
    scale_(flat, prescale_factor)
    with translated_errors():
        return dist.all_reduce(flat, op=reduce_op, async_op=True), size


def start_allreduce(buffers: list, op, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Pending:
    """All-reduce ``buffers`` in place, one fused operation per run of equal dtypes."""
    torch_op(op)
    works, flats = [], []
    for dtype, members in itertools.groupby(buffers, key=lambda t: t.dtype):
        members = list(members)
        for tensor in members:
            _check_dense(tensor)
        flat = members[0] if len(members) == 1 else torch.cat([t.reshape(-1) for t in members])
        work, size = start_flat_allreduce(flat, op, prescale_factor)
        works.append(work)
        flats.append((flat, members))

    def finish():
        for flat, members in flats:
            finish_reduction_(flat, op, postscale_factor, size)
            if len(members) > 1:
                offset = 0
                for tensor in members:
                    tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
        return buffers

    return Pending(works, finish, keep=list(buffers))


def _contiguous_input(tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")


# -- the public all-reduce family --------------------------------------------------
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start an all-reduce into a new tensor; ``synchronize(handle)`` returns it."""
    check_process_set(process_set)
    op = resolve_op(op, average)
    output = tensor.detach().clone(memory_format=torch.contiguous_format)
    pending = start_allreduce([output], op, prescale_factor, postscale_factor)
    return issue(Pending(pending.works, lambda: pending.finish()[0], keep=[tensor, output]))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """Start an in-place all-reduce of ``tensor``."""
    check_process_set(process_set)
    _contiguous_input(tensor)
    op = resolve_op(op, average)
    pending = start_allreduce([tensor.data], op, prescale_factor, postscale_factor)
    return issue(Pending(pending.works, lambda: (pending.finish(), tensor)[1], keep=[tensor]))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    """The gradient of an all-reduce is the same all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor):
        ctx.reduction = (op, prescale_factor, postscale_factor)
        output = tensor.detach().clone(memory_format=torch.contiguous_format)
        return wait(start_allreduce([output], op, prescale_factor, postscale_factor))[0]

    @staticmethod
    def backward(ctx, grad_output):
        op, prescale_factor, postscale_factor = ctx.reduction
        return allreduce(grad_output, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor), None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """The reduction of ``tensor`` over every rank, in a new tensor (differentiable)."""
    check_process_set(process_set)
    op = resolve_op(op, average)
    torch_op(op)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    check_process_set(process_set)
    op = resolve_op(op, average)
    outputs = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    pending = start_allreduce(outputs, op, prescale_factor, postscale_factor)
    return issue(Pending(pending.works, pending.finish, keep=[*tensors, *outputs]))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    check_process_set(process_set)
    for tensor in tensors:
        _contiguous_input(tensor)
    op = resolve_op(op, average)
    pending = start_allreduce([t.data for t in tensors], op, prescale_factor, postscale_factor)
    return issue(Pending(pending.works, lambda: (pending.finish(), list(tensors))[1], keep=list(tensors)))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale_factor, postscale_factor, *tensors):
        ctx.reduction = (op, prescale_factor, postscale_factor)
        outputs = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
        return tuple(wait(start_allreduce(outputs, op, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        op, prescale_factor, postscale_factor = ctx.reduction
        reduced = grouped_allreduce(list(grad_outputs), op=op, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor)
        return (None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce a list of tensors in one fused operation; a list of new tensors."""
    check_process_set(process_set)
    op = resolve_op(op, average)
    torch_op(op)
    compressed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(op, prescale_factor, postscale_factor, *[c for c, _ in compressed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]
