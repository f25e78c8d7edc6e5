"""The live shards a commit copies, found once per layout instead of once per commit.

A commit of a ``ShardedState`` copies every sharded tensor's local rows into a slot
(``slots.py``). Finding those tensors walks the module (``named_parameters``) and the
optimizer's state, and reading a DTensor's local rows (``to_local``) goes through
torch's dispatcher: together they cost more than copying a few MB. Between two
commits of one ring the tensors are the same objects with the same storage (FSDP2 and
the optimizers update them in place), so ``LiveShards`` finds them once and a commit
checks only that nothing was replaced: the optimizer's state entries counted, and each
local tensor's identity and storage address compared. A new optimizer state (Adam's
at its first step), an FSDP2 lazy init that gives a parameter new storage, or a new
model after a re-shard makes a new ``LiveShards``.

The copy itself is one ``torch._foreach_copy_`` over all tensors into views of the
slot shaped like the local tensors (cached per slot), not one Python call each.
"""

from __future__ import annotations

from typing import Hashable

import torch
from torch.distributed.tensor import DTensor

from . import modules


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    # ``_local_tensor`` is the DTensor's own field: reading it costs an attribute lookup,
    # where ``to_local()`` builds a new view through the dispatcher.
    return getattr(tensor, "_local_tensor", None) if isinstance(tensor, DTensor) else tensor


def signature(optimizer, tensors: dict[str, torch.Tensor]) -> Hashable:
    """Changes when a commit would read other tensors or other storage than before."""
    entries = sum(len(s) for s in optimizer.state.values()) if optimizer is not None else 0
    locals_ = []
    for tensor in tensors.values():
        local = _local_tensor(tensor)
        locals_.append((id(local), local.data_ptr()) if local is not None else None)
    return len(optimizer.state) if optimizer is not None else 0, entries, tuple(locals_)


class LiveShards:
    """The sharded tensors of ``model`` and ``optimizer``: keys, layout, local rows."""

    def __init__(self, model: torch.nn.Module, optimizer):
        self.model, self.optimizer = model, optimizer
        self.names = {p: fqn for fqn, p in model.named_parameters()}  # describe() names optimizer state by fqn
        self.tensors = modules.sharded_tensors(model, optimizer)
        self.layout = modules.layout_of(self.tensors)
        self.sources = [modules.local(t) for t in self.tensors.values()]
        self._signature = signature(optimizer, self.tensors)

    def current(self, model: torch.nn.Module, optimizer) -> bool:
        """Whether a commit of ``model`` and ``optimizer`` reads exactly these tensors."""
        if model is not self.model or optimizer is not self.optimizer:
            return False
        if optimizer is not None and len(optimizer.state) != self._signature[0]:
            return False  # cheap first: a step that created optimizer state
        return signature(optimizer, self.tensors) == self._signature


def live_shards(previous: "LiveShards | None", model: torch.nn.Module, optimizer) -> LiveShards:
    """``previous`` while it is current, else the tensors found anew."""
    if previous is not None and previous.current(model, optimizer):
        return previous
    return LiveShards(model, optimizer)


def free_storage(model: torch.nn.Module, optimizer) -> int:
    """Free the memory of a model and optimizer that no ring will use again, now; returns
    the bytes freed. FSDP2's module graph holds reference cycles, so dropping the last
    reference frees nothing until a garbage collection runs, and after an aborted ring
    the runtime skips that collection (it is slow under load): a re-shard would build the
    new model beside the old one. Emptying the storages frees it whatever still refers
    to the old objects; a script that kept them (the API says not to) gets a clear error
    from torch on its next use rather than stale values."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    if optimizer is not None:
        tensors += [v for entries in optimizer.state.values() for v in entries.values() if isinstance(v, torch.Tensor)]
    freed = 0
    for tensor in tensors:
        local = _local_tensor(tensor)
        if local is None or local.device.type == "meta":
            continue
        storage = local.untyped_storage()
        try:
            size = storage.nbytes()
            storage.resize_(0)
        except RuntimeError:  # a storage torch does not let us resize (not allocated by torch): left to the collector
            continue
        freed += size
    return freed
