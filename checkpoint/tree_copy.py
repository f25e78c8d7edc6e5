"""Copying a saved tree back into the live one: one walker for every restore.

A rollback, a sync's receive and a durable load all end here: the saved tree (a
snapshot's views, a received commit, a loaded file) becomes the live state without
allocating where the live state already has a tensor of the same shape and dtype at
that place, so model parameters and optimizer buffers keep their identity (DDP and
the optimizer hold references to them) and a state of many GB costs no page faults.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from .snapshot import clone_tree

__all__ = ["copy_into"]


def copy_into(saved: Any, live: Any, path: tuple = (), cuda_paths: frozenset = frozenset()) -> Any:
    """``saved`` as a tree whose tensors are ``live``'s own, overwritten in place, where
    ``live`` has a tensor of the same shape and dtype at the same place, and fresh
    copies elsewhere: on the live tensor's device if there is one at that place, else
    on the CUDA device if ``path`` is in ``cuda_paths``. A rollback then allocates
    nothing: for a state of many GB, fresh tensors cost seconds of page faults on the
    recovery path."""
    if isinstance(saved, torch.Tensor):
        if isinstance(live, torch.Tensor) and live.shape == saved.shape and live.dtype == saved.dtype:
            with torch.no_grad():
                return live.copy_(saved)
        if isinstance(live, torch.Tensor) and live.device != saved.device:
            return saved.detach().to(live.device, copy=True)
        if path in cuda_paths and not saved.is_cuda:
            return saved.detach().to(_cuda_device(), copy=True)
        return clone_tree(saved)
    if isinstance(saved, dict) and isinstance(live, dict):
        copied = type(saved)((key, copy_into(value, live.get(key), path + (key,), cuda_paths))
                             for key, value in saved.items())
        if hasattr(saved, "_metadata"):
            copied._metadata = copy.deepcopy(saved._metadata)
        return copied
    if type(saved) in (list, tuple) and type(live) is type(saved) and len(live) == len(saved):
        return type(saved)(copy_into(s, l, path + (i,), cuda_paths) for i, (s, l) in enumerate(zip(saved, live)))
    if cuda_paths and isinstance(saved, (dict, list, tuple)):
        return _to_recorded(saved, path, cuda_paths)
    return clone_tree(saved)


def _to_recorded(saved: Any, path: tuple, cuda_paths: frozenset) -> Any:
    """A fresh copy of ``saved`` whose tensors are on the device kind they were committed from."""
    if isinstance(saved, torch.Tensor):
        return saved.detach().to(_cuda_device(), copy=True) if path in cuda_paths else clone_tree(saved)
    if isinstance(saved, dict):
        copied = type(saved)((k, _to_recorded(v, path + (k,), cuda_paths)) for k, v in saved.items())
        if hasattr(saved, "_metadata"):
            copied._metadata = copy.deepcopy(saved._metadata)
        return copied
    if type(saved) in (list, tuple):
        return type(saved)(_to_recorded(v, path + (i,), cuda_paths) for i, v in enumerate(saved))
    return clone_tree(saved)


def _cuda_device() -> torch.device:
    """The worker's CUDA device (its slot's: set once at start)."""
    return torch.device("cuda", torch.cuda.current_device())
