"""State: what a worker commits, restores after a failure, and syncs to a new ring.

``commit()`` copies the state into buffers allocated once (``checkpoint.Snapshot``),
never a fresh deep copy, then asks the runtime whether the ring changes at this
commit. ``sync()`` broadcasts rank 0's committed state to every worker of a new
ring: the layout (small, pickled) first, then one flat buffer per dtype.

A receiver keeps its last commit until a sync has fully arrived: it receives into
a second snapshot and swaps the two only when every buffer is in, so a rank 0 lost
half-way leaves ``restore()`` the previous commit. The second snapshot is kept and
reused by the next sync. That costs a receiver one more host copy of the state for
as long as it lives, but a sync needs both copies at its peak anyway, and reusing
the buffers keeps allocation and page faults (seconds for a state of many GB) out
of the recovery path. Rank 0 does not keep one.

Durable checkpoints (``elastic-run --checkpoint-dir``) are written by rank 0 in the
background from its last commit. Disk is only read by a *fresh* rank 0 (one that has
never committed or synced in this process), at its first sync: that is a full
restart. A running job never rolls back to disk, because its rank 0 always holds
the newest committed state in memory. The commit count travels with the state
(``"commits"`` in the tree), so a new rank 0 numbers its checkpoints on from where
the job is, not from where its own process started.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from checkpoint import CheckpointPolicy, DurableWriter, Snapshot, clone_tree, load_latest

from .errors import HostsUpdatedInterrupt, JobStopping

log = logging.getLogger(__name__)

_RESERVED = ("model", "optimizer", "sampler")
_COMMITS = "commits"  # key of the commit count in committed and durable trees


def checkpoint_policy(config) -> Optional[CheckpointPolicy]:
    """The durable-checkpoint policy that ``elastic-run --checkpoint-*`` asked for."""
    if config is None or not getattr(config, "checkpoint_dir", None):
        return None
    return CheckpointPolicy(
        config.checkpoint_dir,
        every_commits=config.checkpoint_every,
        every_seconds=config.checkpoint_interval,
        keep=config.checkpoint_keep,
    )


class State:
    """Plain values committed and synced as a unit (Horovod's ``ObjectState``)."""

    def __init__(self, **values: Any):
        object.__setattr__(self, "_value_names", tuple(values))
        object.__setattr__(self, "_snapshot", Snapshot())
        object.__setattr__(self, "_spare", None)  # a receiver's buffers for the next sync
        object.__setattr__(self, "_reset_callbacks", [])
        object.__setattr__(self, "_commits", 0)
        object.__setattr__(self, "_rng", None)
        object.__setattr__(self, "_policy", None)  # durable checkpoints, if any
        object.__setattr__(self, "_policy_resolved", False)  # runtime's config looked at
        object.__setattr__(self, "_writer", None)  # created when this worker is rank 0
        object.__setattr__(self, "_durable_step", None)  # newest step on disk or being written
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
        tree = self.state_tree()
        tree[_COMMITS] = self._commits
        self._snapshot.capture(tree)
        # RNG state is per worker: restored on this worker, never broadcast.
        object.__setattr__(self, "_rng", torch.get_rng_state())
        object.__setattr__(self, "_fresh", False)

    def commit(self) -> None:
        """Snapshot the state; raise HostsUpdatedInterrupt if the ring changes here."""
        from . import _runtime  # the process-wide runtime, set by elastic.init()

        runtime = _runtime()
        runtime.fence()
        self._resolve_policy(runtime)
        object.__setattr__(self, "_commits", self._commits + 1)
        self.save()
        if self._policy is not None and runtime.rank == 0:
            writer = self._rank0_writer()
            if writer.due(self._commits):
                self._submit(writer, runtime)
        action = runtime.note_commit(self._commits)
        if action == "stop":
            raise JobStopping(f"job stops after commit {self._commits}")
        if action == "switch":
            raise HostsUpdatedInterrupt(f"ring changes after commit {self._commits}")

    def restore(self) -> None:
        """Roll the live state back to the last commit."""
        if self._snapshot.empty:
            return
        self._load(self._snapshot.tree())
        if self._rng is not None:
            torch.set_rng_state(self._rng)

    def sync(self) -> None:
        """Make every worker's state rank 0's committed state."""
        from . import _runtime

        runtime = _runtime()
        self._resolve_policy(runtime)
        if runtime.rank == 0:
            if self._fresh:
                self._load_durable()
            self.save()
        if runtime.world_size == 1:
            return
        started = time.monotonic()
        layout = [self._snapshot.layout() if runtime.rank == 0 else None]
        dist.broadcast_object_list(layout, src=0)
        if runtime.rank == 0:
            object.__setattr__(self, "_spare", None)  # only receivers need one
            for buffer in self._snapshot.buffers():
                _broadcast_from_rank0(buffer, runtime.backend)
        else:
            # Receive beside the last commit, never into it: if rank 0 is lost half-way,
            # restore() must still find the commit, not zeros or half of the new state.
            receiving = self._spare if self._spare is not None else Snapshot()
            receiving.adopt_layout(layout[0])
            for buffer in receiving.buffers():
                _broadcast_from_rank0(buffer, runtime.backend)
            # Every buffer arrived: the received state is the commit now. The previous
            # commit's buffers receive the next sync (same layout: no allocation).
            previous = self._snapshot
            object.__setattr__(self, "_snapshot", receiving)
            object.__setattr__(self, "_spare", None if previous.empty else previous)
            self._load(self._snapshot.tree())
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
        """Write durable checkpoints per ``policy`` (elastic-run's options do this)."""
        if not isinstance(policy, CheckpointPolicy):
            raise TypeError(f"enable_checkpoints needs a CheckpointPolicy, got {type(policy).__name__}")
        object.__setattr__(self, "_policy", policy)
        object.__setattr__(self, "_policy_resolved", True)  # an explicit policy wins
        object.__setattr__(self, "_writer", None)

    def flush_checkpoints(self, final: bool = False) -> None:
        """Wait for the in-flight write; with ``final``, make the last commit durable."""
        from . import _runtime

        runtime = _runtime()
        if self._policy is None or runtime.rank != 0:
            return
        writer = self._rank0_writer()
        # The agent gives a worker that says it is writing the final checkpoint
        # --final-checkpoint-timeout, not the moment it gives the others at the end.
        marker = getattr(runtime.config, "final_checkpoint_file", None) if final else None
        if marker:
            _touch(marker)
        try:
            writer.flush()
            already_durable = self._durable_step == self._commits and writer.last_error is None
            if final and not self._snapshot.empty and not already_durable:
                self._submit(writer, runtime)
                writer.flush()
        finally:
            if marker:
                _remove(marker)

    def _resolve_policy(self, runtime) -> None:
        """Take the policy from the worker's config once (on the first sync or commit)."""
        if self._policy_resolved:
            return
        object.__setattr__(self, "_policy_resolved", True)
        object.__setattr__(self, "_policy", checkpoint_policy(runtime.config))

    def _rank0_writer(self) -> DurableWriter:
        # Created only on rank 0, and only when first needed: a new writer removes
        # stale temporary directories, which must never be a live rank 0's write.
        if self._writer is None:
            from . import _runtime

            # Each write's outcome becomes an event: the agent's metrics read it (agent/metrics.py).
            object.__setattr__(self, "_writer", DurableWriter(self._policy, report=_runtime().events.emit))
        return self._writer

    def _submit(self, writer: DurableWriter, runtime) -> None:
        """Write the last commit (the snapshot just taken) in the background."""
        if writer.submit(
            self._snapshot.tree(),
            step=self._commits,
            epoch=self._int_value("epoch"),
            round=runtime.round,
            world_size=runtime.world_size,
            still_current=runtime.durable_fence(),
        ):
            object.__setattr__(self, "_durable_step", self._commits)

    def _load(self, tree: dict) -> None:
        """Make the live state ``tree``'s, commit count included."""
        self.load_tree(tree)
        commits = tree.get(_COMMITS)
        if isinstance(commits, int):
            object.__setattr__(self, "_commits", commits)

    def _load_durable(self) -> None:
        if self._policy is None:
            return
        directory = self._policy.directory
        try:
            found = load_latest(directory)
        except OSError as exc:
            # A failing checkpoint directory must not stop training (the writer
            # reports each failed write too).
            log.error("cannot read checkpoints in %s: %s; starting from the initial state", directory, exc)
            return
        if found is None:
            log.info("no durable checkpoint in %s: starting from the initial state", directory)
            return
        tree, manifest = found
        self._load(tree)
        step = int(manifest.get("step") or 0)
        object.__setattr__(self, "_commits", step)  # the manifest names the step
        object.__setattr__(self, "_durable_step", step)
        log.info("resumed from durable checkpoint step %s (epoch %s) in %s", step, manifest.get("epoch"), directory)

    def _int_value(self, name: str) -> Optional[int]:
        value = getattr(self, name, None) if name in self._value_names else None
        return value if isinstance(value, int) else None


ObjectState = State


def _touch(path: str) -> None:
    try:
        with open(path, "w"):
            pass
    except OSError as exc:  # the agent then only gives the usual moment
        log.warning("cannot create %s: %s", path, exc)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _broadcast_from_rank0(buffer: torch.Tensor, backend: str) -> None:
    """Snapshot buffers live in (pinned) host memory; NCCL only moves device memory."""
    if backend != "nccl":
        dist.broadcast(buffer, src=0)
        return
    on_device = buffer.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
    dist.broadcast(on_device, src=0)
    buffer.copy_(on_device)


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
