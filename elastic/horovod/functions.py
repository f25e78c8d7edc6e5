"""Horovod's model and optimizer broadcasts: ``broadcast_parameters`` and
``broadcast_optimizer_state``, fused into few collectives per dtype."""

from __future__ import annotations

import itertools
from typing import Iterable

import torch

from . import basics
from ..contract.errors import PeerDataInvalid
from ..worker import wire
from .gather_ops import broadcast_plain, start_broadcast
from .ops import wait

_CHUNK_BYTES = 64 << 20  # one broadcast carries up to this much of a dtype's tensors


def broadcast_tensors_(tensors: Iterable[torch.Tensor], root_rank: int) -> None:
    """Broadcast ``tensors`` in place from ``root_rank``: runs of one dtype travel
    flattened together (gloo pays per operation), in the order given."""
    tensors = [t for t in tensors]
    for _, run in itertools.groupby(tensors, key=lambda t: (t.dtype, t.device)):
        chunk, chunk_bytes = [], 0
        for tensor in run:
            chunk.append(tensor)
            chunk_bytes += tensor.numel() * tensor.element_size()
            if chunk_bytes >= _CHUNK_BYTES:
                _broadcast_chunk(chunk, root_rank)
                chunk, chunk_bytes = [], 0
        if chunk:
            _broadcast_chunk(chunk, root_rank)


def _broadcast_chunk(tensors: list, root_rank: int) -> None:
    datas = [t.data if isinstance(t, torch.nn.Parameter) else t for t in tensors]
    if len(datas) == 1 and datas[0].is_contiguous():
        wait(start_broadcast(datas[0], root_rank))
        return
    flat = torch.cat([d.reshape(-1) for d in datas])
    wait(start_broadcast(flat, root_rank))
    offset = 0
    with torch.no_grad():
        for data in datas:
            data.copy_(flat[offset:offset + data.numel()].view_as(data))
            offset += data.numel()


def broadcast_parameters(params, root_rank: int) -> None:
    """Overwrite ``params`` on every rank with the root's, in place.

    ``params``: a dict such as ``model.state_dict()`` (sent in key order), a list of
    tensors, or a list of ``(name, tensor)``. Anything else, the generator
    ``model.named_parameters()`` included, is a ValueError, as in Horovod."""
    if isinstance(params, dict):
        tensors = [value for _, value in sorted(params.items(), key=lambda item: item[0])]
    elif isinstance(params, list):
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)} (give a dict such as model.state_dict(), "
                         "or a list such as list(model.named_parameters()))")
    for tensor in tensors:
        if not torch.is_tensor(tensor):
            raise ValueError(f"broadcast_parameters: {type(tensor).__name__} is not a tensor")
    broadcast_tensors_(tensors, root_rank)


def _params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _step_with_zero_gradients(optimizer) -> None:
    """Create the optimizer's state where it has none, as Horovod does: zero
    gradients and one step of the wrapped class (never the distributed step)."""
    for p in _params(optimizer):
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    base_step = getattr(optimizer, "wrapped_step", None)
    if base_step is not None:
        base_step()
    else:
        optimizer.step()


def broadcast_optimizer_state(optimizer, root_rank: int, model=None) -> None:
    """Make every rank's optimizer state and options (lr, momentum, betas...) the root's.

    A rank without state first creates it (one step on zero gradients, as in
    Horovod); then the root's layout (which parameter has which state, shapes,
    dtypes, plain values) travels as one object, missing tensors are created from
    it, and the tensors follow fused per dtype."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    basics.require_initialized()
    if len(optimizer.state) == 0:
        _step_with_zero_gradients(optimizer)
    params = _params(optimizer)
    is_root = basics.rank() == root_rank
    layout = None
    if is_root:
        options = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        states = []
        for p in params:
            entries = []
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    entries.append((key, "tensor", tuple(value.shape), str(value.dtype)))
                else:
                    entries.append((key, "value", value))
            states.append(entries)
        layout = (options, states)
    # Plain data, not a pickle: every rank believes the root's layout (wire.py).
    options, states = _checked_layout(broadcast_plain(layout, root_rank))
    if len(options) != len(optimizer.param_groups) or len(states) != len(params):
        raise ValueError("broadcast_optimizer_state: the root's optimizer has other parameter groups than this one's")
    tensors = []
    for group, group_options in zip(optimizer.param_groups, options):
        if not is_root:
            group.update(group_options)
    for p, entries in zip(params, states):
        state = optimizer.state[p]
        for entry in entries:
            key, kind = entry[0], entry[1]
            if kind == "value":
                if not is_root:
                    state[key] = entry[2]
                continue
            shape, dtype = entry[2], wire.dtype_named(entry[3], "optimizer state from the root")
            current = state.get(key)
            if not torch.is_tensor(current) or tuple(current.shape) != shape or current.dtype != dtype:
                device = p.device if len(shape) else (current.device if torch.is_tensor(current) else "cpu")
                state[key] = current = torch.zeros(shape, dtype=dtype, device=device)
            tensors.append(current)
    broadcast_tensors_(tensors, root_rank)


def _checked_layout(layout) -> tuple[list, list]:
    """(options, states) of the root's optimizer as ``broadcast_optimizer_state`` sends them;
    PeerDataInvalid unless every entry has that form."""
    what = "optimizer layout from the root"
    if type(layout) is not tuple or len(layout) != 2 or type(layout[0]) is not list or type(layout[1]) is not list:
        raise PeerDataInvalid(f"{what}: expected (options, states)")
    options, states = layout
    if any(type(o) is not dict for o in options) or any(type(e) is not list for e in states):
        raise PeerDataInvalid(f"{what}: expected a dict per group and a list per parameter")
    for entries in states:
        for entry in entries:
            ok = type(entry) is tuple and len(entry) >= 2 and (
                (entry[1] == "value" and len(entry) == 3)
                or (entry[1] == "tensor" and len(entry) == 4 and type(entry[2]) is tuple
                    and all(type(d) is int and d >= 0 for d in entry[2])))
            if not ok:
                raise PeerDataInvalid(f"{what}: malformed entry {str(entry)[:60]}")
    return options, states
