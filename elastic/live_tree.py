"""The tensors a ``TorchState`` commit copies, found once per layout instead of once per commit.

A commit used to call ``model.state_dict()`` and ``optimizer.state_dict()`` and walk
both trees (``checkpoint/snapshot.py``'s ``_flatten``, a deep copy of the modules'
version metadata, a deep copy of the param groups): about as much time as copying a
few MB. Between two commits of one ring those tensors are the same objects with the
same storage (the optimizer updates them in place), so ``LiveTree`` flattens them once
(``checkpoint.Flat``) and a commit only checks that nothing was replaced: every
parameter's and buffer's identity, storage address and shape, and every optimizer
state entry's. The optimizer's plain values (learning rates, as a scheduler moves
them) are read at every commit, as ``state_dict()`` packs them.

Anything the check could miss falls back to the full ``state_dict()`` calls: a module
or optimizer with state_dict hooks or extra state, an optimizer state entry that is
not a tensor (its value changes with no tensor to copy), a learning rate that is a
tensor. Same idea as ``elastic/sharded/live_shards.py`` for sharded tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from elastic.checkpoint import Flat, Plain


def _module_key(modules: list) -> tuple:
    """Changes when the modules' state_dict would hold other tensors, other storage or
    shapes, or other submodules (``modules``: the model's, found once)."""
    key = []
    for module in modules:
        key.extend(map(id, module._modules.values()))
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                key.append(None if tensor is None else (id(tensor), tensor.data_ptr(), tensor.shape))
    return tuple(key)


def _optimizer_key(optimizer) -> Optional[tuple]:
    """Changes when the optimizer's state_dict would hold other tensors; None when its
    state holds a value that is not a tensor (it has to be read at every commit)."""
    key = []
    state = optimizer.state
    for group in optimizer.param_groups:
        params = group["params"]
        key.append(len(params))
        for param in params:
            key.append(id(param))
            entries = state.get(param)
            if not entries:
                continue
            for name, value in entries.items():
                if not isinstance(value, torch.Tensor):
                    return None
                key.append((name, id(value), value.data_ptr(), value.shape))
    key.append(len(state))
    return tuple(key)


def _model_cacheable(model: torch.nn.Module, tree) -> bool:
    for module in model.modules():
        if module._state_dict_hooks or module._state_dict_pre_hooks or \
                type(module).get_extra_state is not torch.nn.Module.get_extra_state:
            return False
    return all(isinstance(value, torch.Tensor) for value in tree.values())


def _optimizer_cacheable(optimizer) -> bool:
    if optimizer._optimizer_state_dict_pre_hooks or optimizer._optimizer_state_dict_post_hooks:
        return False
    params = [id(p) for group in optimizer.param_groups for p in group["params"]]
    if len(set(params)) != len(params):  # torch packs a repeated parameter under its first index
        return False
    return not any(isinstance(value, torch.Tensor) for group in optimizer.param_groups
                   for name, value in group.items() if name != "params")


def _flat(tree) -> Optional[Flat]:
    """``tree`` flattened, or None when it holds no tensor (an optimizer before its first
    step): then it is read at every commit, and a change of its key finds the tensors."""
    try:
        return Flat(tree)
    except ValueError:
        return None


class LiveTree:
    """A model's and an optimizer's committed tensors, flattened once (``Flat``)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.model_flat = self.state_flat = None
        self._model_key = self._optimizer_key = None
        if model is not None:
            tree = model.state_dict(keep_vars=True)  # the live parameters, not detached aliases
            if _model_cacheable(model, tree):
                self._modules = list(model.modules())
                self.model_flat, self._model_key = _flat(tree), _module_key(self._modules)
        if optimizer is not None and _optimizer_cacheable(optimizer):
            key = _optimizer_key(optimizer)
            if key is not None:
                self.state_flat, self._optimizer_key = _flat(optimizer.state_dict()["state"]), key

    def current(self, model, optimizer) -> bool:
        """Whether a commit of ``model`` and ``optimizer`` reads exactly these tensors."""
        if model is not self.model or optimizer is not self.optimizer:
            return False
        if self._model_key is not None and _module_key(self._modules) != self._model_key:
            return False
        return self._optimizer_key is None or _optimizer_key(optimizer) == self._optimizer_key

    def model_tree(self):
        return self.model_flat if self.model_flat is not None else self.model.state_dict()

    def optimizer_tree(self) -> dict:
        """What ``optimizer.state_dict()`` returns, its state as the cached ``Flat``."""
        if self.state_flat is None:
            return self.optimizer.state_dict()
        groups, start = [], 0
        for group in self.optimizer.param_groups:
            packed = {name: value for name, value in group.items() if name != "params"}
            count = len(group["params"])
            packed["params"] = list(range(start, start + count))  # torch's packing, for distinct params
            start += count
            groups.append(packed)
        return {"state": self.state_flat, "param_groups": Plain(groups)}


def live_tree(previous: Optional[LiveTree], model, optimizer) -> LiveTree:
    """``previous`` while it is current, else the tensors found anew."""
    if previous is not None and previous.current(model, optimizer):
        return previous
    return LiveTree(model, optimizer)
