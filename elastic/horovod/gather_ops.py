"""Horovod's other collectives on torch.distributed: allgather, broadcast, alltoall,
reducescatter, barrier and the object collectives.

Like ops.py, every call uses the ring of the moment (the default process group).
"""

from __future__ import annotations

import io
import pickle

import torch
import torch.distributed as dist

from ..worker import wire
from . import basics
from .common import Average, Compression, check_process_set, global_process_set
from .ops import Pending, divide_, issue, ring_size, scale_, start_allreduce, synchronize, torch_op
from .ops import translated_errors, wait

try:  # Horovod pickles objects with cloudpickle (lambdas, local classes); plain pickle otherwise
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - cloudpickle is in this project's environment
    _pickler = pickle

_MAX_DIMS = 16  # an allgather exchanges shapes of up to this many dimensions


# -- allgather ---------------------------------------------------------------------
def _shape_record(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"allgather: tensors of more than {_MAX_DIMS} dimensions are not supported")
    record = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64)
    record[0] = tensor.dim()
    record[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return record


def start_allgather(tensor: torch.Tensor) -> Pending:
    """Concatenate every rank's tensor on dim 0 (which may differ per rank): the
    shapes are exchanged first, then the tensors padded to the longest."""
    tensor = tensor.detach().contiguous()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    size = ring_size()
    with translated_errors():
        records = [torch.empty(_MAX_DIMS + 1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(records, _shape_record(tensor))
    shapes = [tuple(r[1:1 + int(r[0])].tolist()) for r in records]
    if any(len(s) != len(shapes[0]) or s[1:] != shapes[0][1:] for s in shapes):
        # Every rank sees the same shapes, so every rank raises here: no hang.
        raise ValueError(f"allgather: tensors must match in every dimension but the first; got {shapes}")
    rows = [s[0] for s in shapes]
    longest = max(rows)
    padded = tensor
    if tensor.shape[0] < longest:
        padded = torch.cat([tensor, tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))])
    outputs = [torch.empty_like(padded) for _ in range(size)]
    with translated_errors():
        work = dist.all_gather(outputs, padded, async_op=True)
    return Pending([work], lambda: torch.cat([out[:n] for out, n in zip(outputs, rows)]), keep=[padded])


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    check_process_set(process_set)
    return issue(start_allgather(tensor))


class _Allgather(torch.autograd.Function):
    """The gradient of a rank's slice is its slice of the averaged gradient."""

    @staticmethod
    def forward(ctx, tensor):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return wait(start_allgather(tensor))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce_average(grad_output)
        rows = wait(start_allgather(torch.tensor([ctx.rows], dtype=torch.int64)))
        offset = int(rows[:basics.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows)


def allreduce_average(tensor: torch.Tensor) -> torch.Tensor:
    output = tensor.detach().clone(memory_format=torch.contiguous_format)
    return wait(start_allreduce([output], Average))[0]


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated on dim 0 in rank order (differentiable)."""
    check_process_set(process_set)
    return _Allgather.apply(tensor)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    check_process_set(process_set)
    parts = [start_allgather(t) for t in tensors]
    return issue(Pending([w for p in parts for w in p.works], lambda: [p.finish() for p in parts]))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    check_process_set(process_set)
    return [allgather(t) for t in tensors]


# -- broadcast ---------------------------------------------------------------------
def _check_root(root_rank: int) -> None:
    size = ring_size()
    if not 0 <= int(root_rank) < size:
        raise ValueError(f"root_rank {root_rank} is not a rank of this ring (size {size})")


def start_broadcast(tensor: torch.Tensor, root_rank: int) -> Pending:
    _check_root(root_rank)
    with translated_errors():
        work = dist.broadcast(tensor, src=int(root_rank), async_op=True)
    return Pending([work], lambda: tensor, keep=[tensor])


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    check_process_set(process_set)
    return issue(start_broadcast(tensor.detach().clone(memory_format=torch.contiguous_format), root_rank))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    check_process_set(process_set)
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    pending = start_broadcast(tensor.data, root_rank)
    return issue(Pending(pending.works, lambda: tensor, keep=[tensor]))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    """Only the root's input reaches the output: it gets the averaged gradient, the others zeros."""

    @staticmethod
    def forward(ctx, tensor, root_rank):
        ctx.root_rank = root_rank
        return wait(start_broadcast(tensor.detach().clone(memory_format=torch.contiguous_format), root_rank))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce_average(grad_output)
        if basics.rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """The root's ``tensor`` on every rank, in a new tensor (differentiable)."""
    check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank)


# -- alltoall ----------------------------------------------------------------------
def _send_splits(tensor: torch.Tensor, splits, size: int) -> list:
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if tensor.dim() == 0 or rows % size:
            raise ValueError(f"alltoall: dim 0 ({rows}) must divide by the number of ranks ({size}) "
                             "when no splits are given")
        return [rows // size] * size
    splits = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"alltoall: splits {splits} must be {size} non-negative counts adding up to dim 0 ({rows})")
    return splits


def start_alltoall(tensor: torch.Tensor, splits, with_splits: bool) -> Pending:
    size = ring_size()
    send = _send_splits(tensor, splits, size)
    received = torch.empty(size, dtype=torch.int64)
    with translated_errors():
        dist.all_to_all_single(received, torch.tensor(send, dtype=torch.int64))
    received_list = received.tolist()
    source = tensor.detach().contiguous()
    output = source.new_empty((sum(received_list), *source.shape[1:]))
    with translated_errors():
        work = dist.all_to_all_single(output, source, output_split_sizes=received_list,
                                      input_split_sizes=send, async_op=True)
    result = (lambda: (output, received.to(torch.int32))) if with_splits else (lambda: output)
    return Pending([work], result, keep=[source])


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    check_process_set(process_set)
    return issue(start_alltoall(tensor, splits, with_splits=splits is not None))


class _Alltoall(torch.autograd.Function):
    """The gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx, tensor, splits):
        output, received = wait(start_alltoall(tensor, splits, with_splits=True))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, _grad_received):
        grad, _ = wait(start_alltoall(grad_output, ctx.received, with_splits=True))
        return grad, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows of dim 0 scattered to the ranks (``splits[i]`` rows to rank i, equal parts
    without splits); returns the rows received, and with splits also the counts received."""
    check_process_set(process_set)
    output, received = _Alltoall.apply(tensor, splits)
    return (output, received) if splits is not None else output


# -- reducescatter -----------------------------------------------------------------
def _row_ranges(rows: int, size: int) -> list:
    """Rank r's rows of dim 0: the first ``rows % size`` ranks take one more."""
    base, extra = divmod(rows, size)
    starts, start = [], 0
    for r in range(size):
        count = base + (1 if r < extra else 0)
        starts.append((start, count))
        start += count
    return starts


def start_reducescatter(tensor, op, prescale_factor, postscale_factor) -> Pending:
    reduce_op = torch_op(op)
    size = ring_size()
    buffer = tensor.detach().clone(memory_format=torch.contiguous_format)
    scale_(buffer, prescale_factor)
    with translated_errors():
        # gloo has no reduce_scatter: reduce everything, keep our rows.
        work = dist.all_reduce(buffer, op=reduce_op, async_op=True)

    def finish():
        start, count = _row_ranges(buffer.shape[0], size)[basics.rank()]
        mine = buffer.narrow(0, start, count).clone()
        if op == Average:
            divide_(mine, size)
        scale_(mine, postscale_factor)
        return mine

    return Pending([work], finish)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    check_process_set(process_set)
    return issue(start_reducescatter(tensor, op, prescale_factor, postscale_factor))


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over every rank (default: Average), then rank r keeps its part of dim 0."""
    check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    return compression.decompress(wait(start_reducescatter(compressed, op, prescale_factor, postscale_factor)), ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    return [reducescatter(t, compression=compression, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor) for t in tensors]


# -- the rest ----------------------------------------------------------------------
def barrier(process_set=global_process_set) -> None:
    check_process_set(process_set)
    ring_size()
    with translated_errors():
        dist.barrier()


def join(device=-1) -> int:
    raise NotImplementedError("hvd.join is not supported under elastic-run: it needs Horovod's negotiation "
                              "of collectives by name; give every rank the same number of steps instead")


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """The root's object on every rank (pickled: size first, then the bytes)."""
    check_process_set(process_set)
    _check_root(root_rank)
    if basics.rank() == root_rank:
        payload = torch.frombuffer(bytearray(_pickler.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    with translated_errors():
        dist.broadcast(length, src=root_rank)
        if basics.rank() != root_rank:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=root_rank)
    if basics.rank() == root_rank:
        return obj
    return pickle.load(io.BytesIO(wire.host_bytes(payload)))


MAX_PLAIN_BYTES = 256 << 20  # what broadcast_plain accepts from the root


def broadcast_plain(obj, root_rank=0):
    """The root's value on every rank, as checked plain data (``elastic/worker/wire.py``):
    what the runtime itself broadcasts, so that a peer can make no rank unpickle anything.
    A malformed value is PeerDataInvalid, a ring failure."""
    _check_root(root_rank)
    device = torch.device("cpu")
    with translated_errors():
        body = wire.broadcast_bytes(wire.dumps(obj, tensors=True) if basics.rank() == root_rank else None,
                                    root_rank, basics.rank(), device, f"value from rank {root_rank}",
                                    MAX_PLAIN_BYTES)
    return wire.loads(body, f"value from rank {root_rank}", limit=MAX_PLAIN_BYTES, tensors=True)


def allgather_object(obj, name=None):
    """Every rank's object, in rank order."""
    payload = torch.frombuffer(bytearray(_pickler.dumps(obj)), dtype=torch.uint8)
    lengths = wait(start_allgather(torch.tensor([payload.numel()], dtype=torch.int64))).tolist()
    gathered = wire.host_bytes(wait(start_allgather(payload)))
    objects, offset = [], 0
    for length in lengths:
        objects.append(pickle.loads(gathered[offset:offset + length]))
        offset += length
    return objects

