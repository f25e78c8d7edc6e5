"""State: what a worker commits, restores after a failure, and syncs to a new ring.

``commit()`` copies the state into buffers allocated once (``checkpoint.Snapshot``),
never a fresh deep copy, then asks the runtime whether the ring changes at this
commit. ``sync()`` broadcasts rank 0's committed state to every worker of a new
ring: the layout (small, pickled) first, then one flat buffer per dtype.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from checkpoint import CheckpointPolicy, DurableWriter, Snapshot, clone_tree, load_latest

from .errors import HostsUpdatedInterrupt

log = logging.getLogger(__name__)

_RESERVED = ("model", "optimizer", "sampler")


class State:
    """Plain values committed and synced as a unit (Horovod's ``ObjectState``)."""

    def __init__(self, **values: Any):
        object.__setattr__(self, "_value_names", tuple(values))
        object.__setattr__(self, "_snapshot", Snapshot())
        object.__setattr__(self, "_reset_callbacks", [])
        object.__setattr__(self, "_commits", 0)
        object.__setattr__(self, "_rng", None)
        object.__setattr__(self, "_writer", None)
        object.__setattr__(self, "_fresh", True)  # never committed or synced in this process
        for name, value in values.items():
            object.__setattr__(self, name, value)

    # -- what the state is --------------------------------------------------
    def state_tree(self) -> dict:
        """The live state as a tree of tensors and plain values (no copies)."""
        return {"values": {name: getattr(self, name) for name in self._value_names}}

    def load_tree(self, tree: dict) -> None:
        """Make the live state equal to ``tree`` (copying: the tree may be a snapshot)."""
        for name, value in tree["values"].items():
            object.__setattr__(self, name, copy.deepcopy(value))

    # -- the API --------------------------------------------------------------
    def save(self) -> None:
        self._snapshot.capture(self.state_tree())
        # RNG state is per worker: restored on this worker, never broadcast.
        object.__setattr__(self, "_rng", torch.get_rng_state())
        object.__setattr__(self, "_fresh", False)

    def commit(self) -> None:
        """Snapshot the state; raise HostsUpdatedInterrupt if the ring changes here."""
        from . import _runtime  # the process-wide runtime, set by elastic.init()

        self.save()
        object.__setattr__(self, "_commits", self._commits + 1)
        runtime = _runtime()
        if self._writer is not None and runtime.rank == 0 and self._writer.due(self._commits):
            self._writer.submit(
                self.state_tree(),
                step=self._commits,
                epoch=self._int_value("epoch"),
                round=runtime.round,
                world_size=runtime.world_size,
            )
        if runtime.note_commit():
            raise HostsUpdatedInterrupt(f"ring changes after commit {self._commits}")

    def restore(self) -> None:
        """Roll the live state back to the last commit."""
        if self._snapshot.empty:
            return
        self.load_tree(self._snapshot.tree())
        if self._rng is not None:
            torch.set_rng_state(self._rng)

    def sync(self) -> None:
        """Make every worker's state rank 0's committed state."""
        from . import _runtime

        runtime = _runtime()
        if runtime.rank == 0:
            if self._fresh:
                self._load_durable()
            self.save()
        if runtime.world_size == 1:
            return
        started = time.monotonic()
        layout = [self._snapshot.layout() if runtime.rank == 0 else None]
        dist.broadcast_object_list(layout, src=0)
        if runtime.rank != 0:
            object.__setattr__(self, "_snapshot", Snapshot.from_layout(layout[0]))
        for buffer in self._snapshot.buffers():
            dist.broadcast(buffer, src=0)
        if runtime.rank != 0:
            self.load_tree(self._snapshot.tree())
            object.__setattr__(self, "_rng", torch.get_rng_state())
            object.__setattr__(self, "_fresh", False)
        log.debug("sync of %d bytes took %.3fs", self._snapshot.nbytes, time.monotonic() - started)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    # -- durable checkpoints ----------------------------------------------------
    def enable_checkpoints(self, policy: CheckpointPolicy) -> None:
        object.__setattr__(self, "_writer", DurableWriter(policy))

    def flush_checkpoints(self, final: bool = False) -> None:
        """Wait for the in-flight write; with ``final``, write the last commit first."""
        from . import _runtime

        if self._writer is None or _runtime().rank != 0:
            return
        if final and not self._snapshot.empty:
            self._writer.flush()
            self._writer.submit(
                self._snapshot.tree(),
                step=self._commits,
                epoch=self._int_value("epoch"),
                round=_runtime().round,
                world_size=_runtime().world_size,
            )
        self._writer.flush()

    def _load_durable(self) -> None:
        if self._writer is None:
            return
        found = load_latest(self._writer.policy.directory)
        if found is None:
            return
        tree, manifest = found
        self.load_tree(tree)
        object.__setattr__(self, "_commits", int(manifest.get("step") or 0))
        log.info(
            "resumed from durable checkpoint step %s (epoch %s) in %s",
            manifest.get("step"), manifest.get("epoch"), self._writer.policy.directory,
        )

    def _int_value(self, name: str) -> Optional[int]:
        value = getattr(self, name, None) if name in self._value_names else None
        return value if isinstance(value, int) else None


ObjectState = State


class TorchState(State):
    """A model, its optimizer, an ``ElasticSampler`` and plain values."""

    def __init__(self, model=None, optimizer=None, sampler=None, **values: Any):
        for name in values:
            if name in _RESERVED:
                raise ValueError(f"{name!r} is reserved by TorchState")
        super().__init__(**values)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "sampler", sampler)

    def state_tree(self) -> dict:
        tree = super().state_tree()
        if self.model is not None:
            tree["model"] = self.model.state_dict()
        if self.optimizer is not None:
            tree["optimizer"] = self.optimizer.state_dict()
        if self.sampler is not None:
            tree["sampler"] = self.sampler.state_dict()
        return tree

    def load_tree(self, tree: dict) -> None:
        super().load_tree(tree)
        if self.model is not None:
            self.model.load_state_dict(tree["model"])  # copies into the live parameters
        if self.optimizer is not None:
            # A fresh copy: the optimizer must never alias the snapshot's buffers.
            self.optimizer.load_state_dict(clone_tree(tree["optimizer"]))
        if self.sampler is not None:
            self.sampler.load_state_dict(copy.deepcopy(tree["sampler"]))

    def on_reset(self) -> None:
        from . import _runtime

        if self.sampler is not None and hasattr(self.sampler, "set_rank"):
            runtime = _runtime()
            self.sampler.set_rank(runtime.rank, runtime.world_size)
        super().on_reset()
