"""``hvd.elastic``'s states: Horovod's ``ObjectState`` and ``TorchState`` on this runtime's State.

Everything a Horovod state does is kept: plain values and any number of models,
optimizers, samplers and other objects with ``state_dict()`` (schedulers, scalers:
``elastic/stateful.py``, as in ``elastic.TorchState``) under any names, ``commit()``, ``restore()``, ``sync()``,
``check_host_updates()``, ``register_reset_callbacks``, and ``state.model = other``
swapping a handled object. Underneath it is ``elastic.State``: a commit copies into
buffers allocated once (no deep copy per commit), a sync moves nothing between workers
that already hold the ring's newest commit, and a failure rolls back to the last commit.

Differences from Horovod, each deliberate:

* Reset callbacks run after the new ring has synced, so they see the synced state
  (Horovod runs them before its sync: its issue 2844). They run after every
  re-formation, on every worker of the new ring (a joiner or a replacement too), and
  not when the job first starts, as in Horovod.
* Every re-formation syncs; Horovod skips the sync after a removal (issue 3494, a
  deadlock when joiners then arrive; issue 3399, repeated samples).
* ``check_host_updates()`` takes a pending membership change there and then with
  nothing rolled back: if rank 0 sees a newer ring ready, every worker commits and
  raises ``HostsUpdatedInterrupt`` at the same call. (Horovod raises without a commit,
  then mixes rolled-back plain values with live model and optimizer state.) It costs
  one broadcast of one integer, as Horovod's costs a ``broadcast_object``.
* Plain values are committed by value, not by reference (an in-place
  ``state.img_secs.append`` after a commit is undone by a rollback).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...contract.errors import HostsUpdatedInterrupt
from elastic.checkpoint import copy_into
from ...commit_book import put
from ...state import State, StateBook
from ...stateful import is_stateful, load_state
from ...worker.ring_view import RingView
from .sampler import ElasticSampler

MODEL, OPTIMIZER, SAMPLER, OBJECT = "model", "optimizer", "sampler", "object with state_dict()"


def handled_kind(value: Any) -> Optional[str]:
    """What a TorchState does with ``value``: a model, an optimizer, a sampler, another object
    with ``state_dict()``/``load_state_dict()`` (a scheduler, a GradScaler), or None (a plain value)."""
    if isinstance(value, torch.nn.Module):
        return MODEL
    if isinstance(value, torch.optim.Optimizer):
        return OPTIMIZER
    if isinstance(value, ElasticSampler):
        return SAMPLER
    if is_stateful(value):
        return OBJECT
    return None


@dataclass
class HorovodBook(StateBook):
    """What a Horovod state keeps besides a ``State``'s bookkeeping."""

    entered: bool = False  # the training function ran in this process
    handled: dict[str, str] = field(default_factory=dict)  # a TorchState's objects by name: their kind


class ObjectState(State):
    """Plain values committed, restored and synced as a unit (Horovod's ``ObjectState``).

    Horovod's ``ObjectState(bcast_object, get_rank, **kwargs)`` takes two functions this
    runtime does not need; they are accepted and ignored."""

    _Book = HorovodBook

    def __init__(self, bcast_object=None, get_rank=None, **kwargs: Any):
        super().__init__(**kwargs)

    def check_host_updates(self) -> None:
        """Take a pending membership change here: commit, then raise HostsUpdatedInterrupt
        on every worker at this same call. Nothing happens when none is pending."""
        if not _ring_change_ready(self._ring_now()):
            return
        self.commit()  # raises HostsUpdatedInterrupt itself when this commit is a switch point
        raise HostsUpdatedInterrupt(f"ring changes at check_host_updates (commit {self._book.count})")

    def sync(self, ring: Optional[RingView] = None):
        """Make every worker hold the ring's newest commit. Horovod scripts may call it
        themselves (``state.sync()``): then on the ring this worker trains on now."""
        return super().sync(ring if ring is not None else self._ring_now())

    def on_reset(self, ring: RingView) -> None:
        """After the sync of every (re-)entry: user callbacks, except at the job's start."""
        first_entry = not self._book.entered
        self._book.entered = True
        if first_entry and ring.round <= 1:
            return  # the job's first ring: no reset happened (Horovod runs none either)
        super().on_reset(ring)


def _ring_change_ready(ring: RingView) -> bool:
    """Rank 0's answer, the same on every worker: does the ring switch now?"""
    mine = ring.ring_change_ready() if ring.rank == 0 else False
    if ring.world_size <= 1:
        return mine
    on_device = ring.capability.wire_device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_device else torch.device("cpu")
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


class TorchState(ObjectState):
    """Models, optimizers, ``ElasticSampler``s and plain values (Horovod's ``TorchState``).

    ``TorchState(model, optimizer, train_sampler=s, val_sampler=v, epoch=0)``: each value
    is handled by its type (``nn.Module``, ``optim.Optimizer``, ``hvd.elastic.ElasticSampler``,
    anything with ``state_dict()``/``load_state_dict()``), under its name; anything else is a plain value. ``model``/``optimizer`` left ``None``
    are plain ``None`` attributes that a later assignment can fill."""

    def __init__(self, model=None, optimizer=None, **kwargs: Any):
        everything = dict(kwargs)
        if model is not None:
            everything["model"] = model
        if optimizer is not None:
            everything["optimizer"] = optimizer
        handled = {name: kind for name, value in everything.items() if (kind := handled_kind(value)) is not None}
        super().__init__(**{name: value for name, value in everything.items() if name not in handled})
        self._book.handled = handled
        for name in handled:
            put(self, name, everything[name])
        for name in ("model", "optimizer"):
            if name not in everything:
                put(self, name, None)

    def __setattr__(self, name: str, value: Any) -> None:
        kind = handled_kind(value)
        book = self._book
        if name.startswith("_") or (kind is None and name not in book.handled):
            put(self, name, value)  # a plain value (committed if named at construction)
            return
        if kind is None:
            raise TypeError(f"state.{name} holds a {book.handled[name]}; got a {type(value).__name__}")
        # Swap the handled object (a new model, a new optimizer ...) and save it at once, as
        # Horovod does, so that a rollback does not bring the old one's state back.
        book.handled[name] = kind
        if name in book.value_names:
            book.value_names = tuple(n for n in book.value_names if n != name)
        put(self, name, value)
        if book.holds_commit:
            self.save()

    def state_tree(self) -> dict:
        tree = super().state_tree()
        tree["handled"] = {name: getattr(self, name).state_dict() for name in self._book.handled}
        return tree

    def load_tree(self, tree: dict) -> None:
        super().load_tree(tree)
        cuda_paths = self._book.cuda_paths
        for name, saved in tree["handled"].items():
            # The same loading as elastic.TorchState's objects: a module copies into its own
            # tensors, anything else gets its own overwritten in place or fresh copies, never
            # the snapshot's buffers.
            place = ("handled", name)
            load_state(getattr(self, name), saved,
                       lambda value, live, place=place: copy_into(value, live, place, cuda_paths))

    def sync(self, ring: Optional[RingView] = None):
        """Horovod's sync ends with a reset of every sampler: its pass is made afresh from the
        synced progress (a loader iterated after ``state.sync()`` yields what is left)."""
        ring = ring if ring is not None else self._ring_now()
        plan = super().sync(ring)
        self._partition_samplers(ring)
        return plan

    def on_reset(self, ring: RingView) -> None:
        # Every sampler is partitioned among the ring it will iterate on, before any callback.
        self._partition_samplers(ring)
        super().on_reset(ring)

    def _partition_samplers(self, ring: RingView) -> None:
        for name, kind in self._book.handled.items():
            if kind == SAMPLER:
                getattr(self, name).set_rank(ring.rank, ring.world_size)
