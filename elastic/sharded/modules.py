"""Building FSDP2 models and optimizers on a ring's mesh, and reading their shards out.

A sharded commit names every tensor it holds: ``model.<fqn>`` for a parameter,
``optim.<fqn>.<name>`` for an optimizer state sharded like its parameter (Adam's
``exp_avg``); everything else (Adam's ``step``, param groups, module buffers) is small,
the same on every rank, and travels as a plain value in the commit's ``CommitMeta``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor

from ..worker.sync_plan import CommitId
from .reshard_plan import TensorLayout


@dataclass
class CommitMeta:
    """What every rank of a ring holds the same of one commit (small; travels as plain data, meta_wire.py)."""

    commit: CommitId
    world: int  # the ring that made it: its shards are ``shard_rows(n, world, s)``
    layout: tuple[TensorLayout, ...]
    values: dict = field(default_factory=dict)  # the user's plain values
    sampler: Optional[dict] = None
    buffers: dict = field(default_factory=dict)  # module buffers (not sharded by FSDP2)
    groups: Optional[list] = None  # optimizer param groups, params named by fqn
    plain_state: dict = field(default_factory=dict)  # fqn -> {name: value} not sharded
    scheduler: Optional[dict] = None  # the LR scheduler's state_dict (plain values)


def default_shard(module: torch.nn.Module, mesh) -> None:
    """``fully_shard`` each direct child that has parameters, then the root."""
    from torch.distributed.fsdp import fully_shard

    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(module, mesh=mesh)


def build_sharded(factory: Callable[[], torch.nn.Module], shard: Callable, mesh, device: torch.device):
    """The factory's module built without memory (meta), sharded over ``mesh``, then given
    uninitialised storage for its shards only: never the whole model on one worker."""
    with torch.device("meta"):
        module = factory()
    shard(module, mesh)
    module.to_empty(device=device)
    return module


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The rows this rank holds of a (possibly sharded) tensor, as a plain tensor."""
    return tensor.to_local().detach() if isinstance(tensor, DTensor) else tensor.detach()


def sharded_tensors(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """key -> the live tensor (a DTensor once sharded) of every sharded tensor, in order."""
    tensors = {f"model.{fqn}": p for fqn, p in model.named_parameters()}
    if optimizer is not None:
        names = {p: fqn for fqn, p in model.named_parameters()}
        for fqn, p in model.named_parameters():
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, DTensor) and value.shape == p.shape:
                    tensors[f"optim.{names[p]}.{name}"] = value
    return tensors


def layout_of(tensors: dict[str, torch.Tensor]) -> tuple[TensorLayout, ...]:
    return tuple(TensorLayout(key, tuple(t.shape), str(t.dtype).replace("torch.", "")) for key, t in tensors.items())


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory: the meta travels pickled, and a pickled CUDA tensor comes back
    on the sender's GPU index (a context there, or an error where that index is not
    visible). Loading copies buffers into the module's own, and the optimizer's
    load_state_dict puts state on its parameter's device."""
    return tensor.detach().to("cpu", copy=True)


# Device tensors up to this size travel to the host together (``host_copies``); a larger
# one is copied alone: its copy is long enough for one wait not to matter, and gathering
# it would take as much device memory again.
SMALL_BYTES = 1 << 20


def gathered_groups(tensors: list[torch.Tensor], small_bytes: int = SMALL_BYTES) -> dict[torch.device, list[int]]:
    """Device -> the indices of ``tensors`` that ``host_copies`` copies to the host together:
    plain, strided, small ones off the CPU (a host tensor needs no transfer; a subclass
    such as a DTensor, or a sparse or quantized tensor, keeps its own ``to``)."""
    groups: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if (type(tensor) is torch.Tensor and tensor.device.type != "cpu" and tensor.layout == torch.strided
                and not tensor.is_quantized and not tensor.is_conj() and not tensor.is_neg()
                and tensor.numel() * tensor.element_size() <= small_bytes):
            groups.setdefault(tensor.device, []).append(index)
    return groups


def copy_gathered(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors`` (one device, any dtypes and shapes) in one transfer: their
    bytes concatenated where they are, copied to the host at once, then split into tensors
    of their own (each with its own storage, as ``_host_copy`` gives)."""
    if not tensors:
        return []
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    host = torch.cat(flat).to("cpu")
    out, start = [], 0
    for tensor, part in zip(tensors, flat):
        length = part.numel()
        # The clone first: a piece of the joint buffer may start at an offset its dtype's
        # size does not divide, which view(dtype) refuses.
        out.append(host.narrow(0, start, length).clone().view(tensor.dtype).reshape(tensor.shape))
        start += length
    return out


def host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[_host_copy(t) for t in tensors]``, equal value for value, with one transfer (one
    wait) per device for the small device tensors: Adam with ``fused`` or ``capturable``
    keeps a ``step`` tensor per parameter on the device, hundreds of waits per commit
    copied one by one (gpu review 3, N10)."""
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    for indices in gathered_groups(tensors).values():
        for index, copy_ in zip(indices, copy_gathered([tensors[i] for i in indices])):
            out[index] = copy_
    return [copy_ if copy_ is not None else _host_copy(tensor) for copy_, tensor in zip(out, tensors)]


def describe(commit: CommitId, world: int, model, optimizer, tensors, values: dict, sampler, *,
             layout: Optional[tuple[TensorLayout, ...]] = None, names: Optional[dict] = None) -> CommitMeta:
    """The commit's meta: the layout and every small replicated value (copies). ``layout``
    and ``names`` (parameter -> fqn), when the caller has them, save walking the model."""
    buffers = dict(model.named_buffers())
    # (fqn, name, value) of every optimizer value the meta carries: its tensors are copied with the buffers
    plain: list[tuple[str, str, Any]] = []
    meta = CommitMeta(commit, world, layout if layout is not None else layout_of(tensors), copy.deepcopy(values),
                      copy.deepcopy(sampler.state_dict()) if sampler is not None else None)
    if optimizer is not None:
        names = names if names is not None else {p: fqn for fqn, p in model.named_parameters()}
        meta.groups = [{**{k: copy.deepcopy(v) for k, v in group.items() if k != "params"},
                        "params": [names[p] for p in group["params"]]} for group in optimizer.param_groups]
        for p, entries in optimizer.state.items():
            plain += [(names[p], name, v) for name, v in entries.items() if f"optim.{names[p]}.{name}" not in tensors]
    held = list(buffers.values()) + [v for _, _, v in plain if isinstance(v, torch.Tensor)]
    copies = iter(host_copies(held))
    meta.buffers = {name: next(copies) for name in buffers}
    for fqn, name, value in plain:
        meta.plain_state.setdefault(fqn, {})[name] = next(copies) if isinstance(value, torch.Tensor) \
            else copy.deepcopy(value)
    return meta


def empty_optimizer_state(model, meta: CommitMeta) -> dict[str, torch.Tensor]:
    """key -> a new sharded tensor (like its parameter) for each optimizer state the commit holds,
    uninitialised: the re-shard's pieces (or a hybrid restore) write every element of it, and
    zero-filling Adam's two states first cost 0.1-0.2 s of a 1 GB restore."""
    params = dict(model.named_parameters())
    out = {}
    for tensor in meta.layout:
        if tensor.key.startswith("optim."):
            fqn, _, _ = tensor.key[len("optim."):].rpartition(".")
            out[tensor.key] = torch.empty_like(params[fqn].detach())
    return out


def load_optimizer(optimizer, model, meta: CommitMeta, states: dict[str, torch.Tensor]) -> None:
    """Make ``optimizer`` hold the commit's state: ``states`` (filled) and the plain values."""
    if meta.groups is None:
        return
    order = [p for group in optimizer.param_groups for p in group["params"]]
    names = {p: fqn for fqn, p in model.named_parameters()}
    index = {names[p]: i for i, p in enumerate(order)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in states.items():
        fqn, _, name = key[len("optim."):].rpartition(".")
        state.setdefault(index[fqn], {})[name] = value
    for fqn, plain in meta.plain_state.items():
        state.setdefault(index[fqn], {}).update(copy.deepcopy(plain))
    groups = [{**group, "params": [index[fqn] for fqn in group["params"]]} for group in meta.groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def scheduler_state(scheduler) -> Optional[dict]:
    """A copy of the scheduler's state_dict for a commit (None without a scheduler)."""
    return copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None


def load_scheduler(scheduler, saved: Optional[dict]) -> None:
    """Give a scheduler built on a new ring's optimizer its committed state. It was built
    before the optimizer's state was loaded: building one writes the optimizer's learning
    rates (its first step), which the loaded param groups then overwrite with the commit's."""
    if scheduler is not None and saved is not None:
        scheduler.load_state_dict(copy.deepcopy(saved))
