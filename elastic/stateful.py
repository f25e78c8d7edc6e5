"""Objects with ``state_dict()``/``load_state_dict()`` in a state: schedulers, scalers, EMA weights.

A state keyword whose value has both methods (an LR scheduler, ``torch.amp.GradScaler``,
``torch.optim.swa_utils.AveragedModel``, a ``StatefulStream`` of loaders, a class of the user's)
is committed as its ``state_dict()`` and given back through ``load_state_dict()``. The
state_dict is part of the commit's tree, so its tensors go into the same reusable
snapshot buffers as the model's (a commit is a ``copy_``, never a fresh allocation),
travel to joiners with the rest of the commit, and are written to durable checkpoints
with it. Any other keyword must be a plain value: tensors and int/float/str/bool/None/
bytes, nested in dicts, lists and tuples; anything else is refused when the state is
built, in one line that names the keyword.

Used by ``elastic.TorchState`` and by the Horovod layer's ``hvd.elastic.TorchState``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from elastic.checkpoint import Snapshot

ACCEPTED = ("an object with state_dict() and load_state_dict() (an LR scheduler, a GradScaler, an AveragedModel, "
            "an elastic.StatefulStream), or a plain value: tensors and int/float/str/bool/None/bytes in dicts, lists, tuples")


def is_stateful(value: Any) -> bool:
    """True when ``value`` is committed through its ``state_dict()``/``load_state_dict()``."""
    if isinstance(value, type):  # a class passed by mistake has both as plain functions
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def refusal(owner: str, name: str, value: Any, detail: str = "") -> str:
    """The one line that refuses keyword ``name``'s value, saying what is accepted."""
    kind = type(value)
    held = f"{kind.__module__}.{kind.__qualname__}"
    return f"{owner}: keyword {name!r} holds a {held}{detail}; a keyword takes {ACCEPTED}"


def check_plain(owner: str, name: str, value: Any) -> None:
    """Refuse ``value`` now, in one line, unless a commit can hold it as a plain value."""
    try:
        Snapshot.check_tree(value, (name,))
    except ValueError as exc:
        detail = "" if _is_leaf_refusal(value) else f" ({exc})"
        raise TypeError(refusal(owner, name, value, detail)) from None


def _is_leaf_refusal(value: Any) -> bool:
    return not isinstance(value, (dict, list, tuple))


def is_per_rank_stream(obj: Any) -> bool:
    """A loader or an iterable data set: its state_dict() is one rank's position in its split."""
    from torch.utils.data import DataLoader, IterableDataset

    return isinstance(obj, (DataLoader, IterableDataset))


def state_of(owner: str, name: str, obj: Any) -> Any:
    """``obj.state_dict()``, refused in one line if a commit cannot hold what it returns
    (the first commit is where a user's class shows what its state_dict holds).

    A loader or a stream is refused too: committed as one keyword it would hold one
    rank's position, and a joiner or a renumbered rank would take another rank's, or a
    resume at another world size would go on from positions of another split, repeating
    and skipping samples silently (``elastic/data/stream.py``)."""
    if is_per_rank_stream(obj):
        raise TypeError(f"{owner}: keyword {name!r} holds a {type(obj).__qualname__}, whose state_dict() is one "
                        f"rank's position: commit it as elastic.StatefulStream(make) with make(rank, world) "
                        f"building the loader (the same world size resumes it), or read the data through "
                        f"elastic.ShardedSource (any world size)")
    saved = obj.state_dict()
    try:
        Snapshot.check_tree(saved, (name,))
    except ValueError as exc:
        raise TypeError(f"{owner}: keyword {name!r}: the state_dict() of its {type(obj).__qualname__} cannot be "
                        f"committed: {exc}") from None
    return saved


def load_state(obj: Any, saved: Any, copy_into: Callable[[Any, Any], Any]) -> None:
    """Give ``obj`` the committed ``saved`` (a tree that may be a snapshot's views);
    ``copy_into(saved, live)`` is ``saved`` with ``live``'s tensors overwritten in place
    (``elastic.checkpoint.copy_into`` at the object's place in the tree).

    A module copies into its own parameters and buffers itself. Anything else gets its
    own tensors overwritten in place where their shapes match (no allocation on the
    recovery path) and fresh copies elsewhere, never the snapshot's buffers, which the
    next commit overwrites: an optimizer or a user's class may keep what it is given."""
    if isinstance(obj, torch.nn.Module):
        obj.load_state_dict(saved)
        return
    if _tensor_free(saved):
        obj.load_state_dict(copy.deepcopy(saved))  # a scheduler's, a scaler's: plain values only
        return
    obj.load_state_dict(copy_into(saved, obj.state_dict()))


def _tensor_free(tree: Any) -> bool:
    if isinstance(tree, torch.Tensor):
        return False
    if isinstance(tree, dict):
        return all(_tensor_free(v) for v in tree.values())
    if type(tree) in (list, tuple):
        return all(_tensor_free(v) for v in tree)
    return True
