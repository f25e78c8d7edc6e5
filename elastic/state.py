"""State: what a worker commits, restores after a failure, and syncs to a new ring.

``commit()`` copies the state into buffers allocated once (``checkpoint.Snapshot``),
never a fresh deep copy, then asks its ring whether the ring changes at this
commit. Each commit has an identity, (the round it was made in, the commit count):
see ``elastic/worker/sync_plan.py`` for why the count alone is not enough.

``sync(ring)`` makes every worker of a new ring hold the ring's newest commit:

1. The ring agrees on the newest commit and who holds it, with one all_gather of
   three integers per worker (never a hash over the tensors).
2. Holders move nothing and load nothing: at a sync the live state of a worker is
   its last commit (``restore()`` ran after a failure; a switch happens at a commit).
   After a failure the survivors are usually all holders, and the sync ends here.
3. Workers behind (rolled back one commit further) and joiners receive the commit's
   layout from the first holder, then the commit striped across all holders, in
   chunks, straight into their snapshot buffers. Holders receive nothing.

A receiver overwrites its own last commit rather than keeping a second copy of the
state, so its peak is the snapshot and the live state. A sync that breaks half-way
leaves a torn snapshot, marked so, and ``restore()`` then takes the commit again
from the live state, which a sync only changes once every byte has arrived.

Durable checkpoints (``elastic-run --checkpoint-dir``) are written by rank 0 in the
background from its last commit. Disk is only read when no worker of the ring holds
a commit (a full restart), by the one worker the others then receive from. A running
job never rolls back to disk. The commit's identity travels with the state
(``"commits"`` and ``"commit_round"`` in the tree), so a new rank 0 numbers its
checkpoints on from where the job is, not from where its own process started.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from elastic.checkpoint import CheckpointPolicy, CheckpointsUnreadable, DurableWriter, Snapshot, copy_into, load_latest

from .commit_book import UNREADABLE_ADVICE, CommitBook, checkpoint_policy, put, values_of
from .contract.console import FILE_ONLY
from .live_tree import LiveTree, live_tree
from .stateful import check_plain, is_stateful, load_state, state_of
from .worker.state_transfer import (CHUNK_BYTES, claim_bounds, gather_holdings, receive_layout, run_transfers,
                                     send_layout)
from .worker import device_commit, lifecycle
from .worker.commit_gate import act_on
from .worker.ring_view import RingView
from .worker.sync_plan import CommitId, SyncPlan, choose_holders, plan_sync

log = logging.getLogger(__name__)

_RESERVED = ("model", "optimizer", "sampler")
_COMMITS = "commits"  # key of the commit count in committed and durable trees
_COMMIT_ROUND = "commit_round"  # key of the round the commit was made in
_OBJECTS = "objects"  # key of the state_dicts of a TorchState's stateful objects (elastic/stateful.py)


def durable_load_wait(ring: RingView) -> float:
    """How long receivers wait for holders[0]'s durable load: it may take as long as a
    rendezvous or a collective may, whichever is longer."""
    return max(ring.config.rdzv_timeout, ring.config.collective_timeout)


@dataclass
class StateBook(CommitBook):
    """A ``State``'s bookkeeping (``elastic/commit_book.py``), in its one private attribute."""

    snapshot: Snapshot = field(default_factory=Snapshot)  # the last commit, in buffers allocated once
    holds_commit: bool = False  # the snapshot is a whole commit
    torn: bool = False  # a sync broke while overwriting the snapshot
    rng: Optional[tuple] = None  # this worker's generators at the last commit
    policy: Optional[CheckpointPolicy] = None  # durable checkpoints, if any
    policy_resolved: bool = False  # the worker's config looked at
    writer: Optional[DurableWriter] = None  # created when this worker is rank 0
    cuda_paths: frozenset = frozenset()  # while loading: the tree's tensors that were CUDA tensors
    live: Optional[LiveTree] = None  # a TorchState's live tensors, found once (live_tree.py)
    object_names: tuple[str, ...] = ()  # a TorchState's objects with state_dict() (stateful.py)
    objects_checked: bool = False  # their state_dicts, checked at the first commit


class State:
    """Plain values committed and synced as a unit (Horovod's ``ObjectState``)."""

    _Book = StateBook  # a subclass with more to keep extends the book, not the namespace

    def __init__(self, **values: Any):
        # The one private attribute: the user's names are the rest (elastic/commit_book.py).
        object.__setattr__(self, "_book", self._Book(value_names=tuple(values)))
        for name, value in values.items():
            put(self, name, value)

    # -- what the state is --------------------------------------------------
    def state_tree(self) -> dict:
        """The live state as a tree of tensors and plain values (no copies)."""
        return {"values": values_of(self, self._book)}

    def load_tree(self, tree: dict) -> None:
        """Make the live state equal to ``tree`` (copying: the tree may be a snapshot).

        A tensor goes back into the live tensor at its place when shapes and dtypes
        match, else to that live tensor's device, else to the device kind the commit
        recorded: a snapshot, a sync and a durable file all hold host copies, and a
        CUDA value must not come back as a CPU one."""
        cuda_paths = self._book.cuda_paths
        for name, value in tree["values"].items():
            live = getattr(self, name, None)
            put(self, name, copy_into(value, live, ("values", name), cuda_paths))

    # -- the API --------------------------------------------------------------
    def commit_tree(self) -> dict:
        """``state_tree()`` as a commit copies it (TorchState: its live tensors found once)."""
        return self.state_tree()

    @staticmethod
    def _ring_now() -> RingView:
        """The ring this worker trains on now: the user's calls (``commit()``, ``save()``,
        Horovod's ``sync()``) take none, so a state asks the process here, and only here."""
        return lifecycle.ring()

    def save(self) -> None:
        """Take the live state as the commit held (its count unchanged)."""
        self._save(self._ring_now)

    def _save(self, ring: Callable[[], RingView]) -> None:
        """``save``, for a capture made on ``ring()`` (asked only by an overlapped copy)."""
        book = self._book
        tree = self.commit_tree()
        tree[_COMMITS] = book.count
        tree[_COMMIT_ROUND] = book.round
        device_commit.prepare(book.snapshot, getattr(self, "optimizer", None), ring)  # GPU, opt-in (docs/gpus.md)
        book.snapshot.capture(tree)
        # RNG state is per worker: restored on this worker, never broadcast.
        book.rng = _rng_states()
        book.holds_commit = True
        book.torn = False

    @property
    def commit_id(self) -> Optional[CommitId]:
        """The identity of the commit this worker holds, or None."""
        book = self._book
        return CommitId(book.round, book.count) if book.holds_commit and not book.torn else None

    def commit(self) -> None:
        """Snapshot the state; raise HostsUpdatedInterrupt if the ring changes here."""
        ring = self._ring_now()
        self._resolve_policy(ring)
        # One call: a worker left behind, or a step made on a broken ring, raises before
        # the capture overwrites the snapshot, the previous commit intact (commit_gate.py).
        act_on(ring.commit(self._capture), self._book.count)

    def _capture(self, ring: RingView) -> int:
        """The state's part of a commit: count it, copy it, hand rank 0's writer what is due."""
        book = self._book
        book.next_commit(ring.round)
        self._save(lambda: ring)
        if book.policy is not None and ring.rank == 0:
            writer = self._rank0_writer(ring)
            if writer.due(book.count):
                self._submit(writer, ring)
        return book.count

    def restore(self) -> None:
        """Roll the live state back to the last commit."""
        book = self._book
        if book.torn:
            # A sync broke while receiving into the snapshot. It had not touched the
            # live state, which still is the commit held before (if any): take it again.
            book.torn = False
            if book.holds_commit:
                self.save()
            else:
                book.snapshot = Snapshot()
            return
        if book.snapshot.empty:
            return
        self._load(book.snapshot.tree(), book.snapshot.cuda_paths())
        if book.rng is not None:
            _set_rng_states(book.rng)

    def sync(self, ring: RingView) -> SyncPlan:
        """Make every worker of ``ring`` hold its newest commit; returns the plan it followed."""
        book = self._book
        self._resolve_policy(ring)
        if not book.synced and book.holds_commit:
            # A commit made before the first sync (outside the training function): the
            # live state may have moved since. A holder must send what it will train on.
            self.restore()
        if ring.world_size == 1:
            if not book.holds_commit:
                self._take_durable_or_initial_state(ring)
            book.synced = True
            return SyncPlan(self.commit_id, (0,), (), ())
        started = time.monotonic()
        holdings = gather_holdings(ring.rank, ring.world_size, self.commit_id, ring.backend,
                                   claim_bounds(ring, self.commit_id))
        newest, holders, receivers = choose_holders(holdings)
        if not receivers:  # every worker holds the newest commit: nothing to move
            book.synced = True
            return SyncPlan(newest, holders, (), ())
        if newest is None and ring.rank == holders[0]:
            self._take_durable_or_initial_state(ring)  # nobody holds a commit: a full restart
        if ring.rank in holders:
            # Every holder holds the same commit, hence the same layout: only the receivers
            # need the first holder's, and only they get it (a holder receives nothing).
            layout = book.snapshot.layout()
            if ring.rank == holders[0]:
                send_layout(layout, receivers, ring.backend)
        else:
            # Nobody holds a commit: holders[0] loads the durable one first (--rdzv-timeout bounds it).
            wait_s = durable_load_wait(ring) if newest is None else None
            layout = receive_layout(holders[0], ring.backend, wait_s=wait_s)
        plan = plan_sync(holdings, [(n, dtype.itemsize) for dtype, _, n in layout.buffers], CHUNK_BYTES)
        if ring.rank in holders:
            moved = run_transfers(plan, ring.rank, book.snapshot.buffers(), ring.backend)
        else:
            moved = self._receive(plan, layout, ring)
        # After a re-formation the worker's reform_done line says how the sync went: on the
        # console a failure is that one line per worker, so this one is for the log file.
        # A worker's first sync (the job's start, a joiner's arrival) has no such line.
        extra = FILE_ONLY if book.synced else None
        book.synced = True
        log.info("round %d: sync of commit %s: %s %.3f MB (%d holders, %d receivers) in %.3fs",
                 ring.round, (plan.newest.round, plan.newest.count) if plan.newest else "initial",
                 "sent" if ring.rank in holders else "received", moved / 1e6, len(holders), len(receivers),
                 time.monotonic() - started, extra=extra)
        return plan

    def _receive(self, plan: SyncPlan, layout, ring: RingView) -> int:
        """Receive the newest commit into the snapshot's buffers, then load it."""
        book = self._book
        # From here the snapshot is no whole commit until every transfer has arrived.
        book.torn = True
        book.snapshot.adopt_layout(layout)
        moved = run_transfers(plan, ring.rank, book.snapshot.buffers(), ring.backend)
        book.torn = False
        self._load(book.snapshot.tree(), book.snapshot.cuda_paths())
        book.holds_commit = True
        book.rng = _rng_states()
        return moved

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call these after every re-formation, on every worker of the new ring (a joiner and a
        replacement too), once the state is synced; not when the job starts."""
        self._book.add_reset_callbacks(callbacks)

    def on_reset(self, ring: RingView) -> None:
        self._book.run_reset_callbacks()

    # -- durable checkpoints ----------------------------------------------------
    def enable_checkpoints(self, policy: CheckpointPolicy) -> None:
        """Write durable checkpoints per ``policy`` (elastic-run's options do this)."""
        if not isinstance(policy, CheckpointPolicy):
            raise TypeError(f"enable_checkpoints needs a CheckpointPolicy, got {type(policy).__name__}")
        book = self._book
        book.policy = policy
        book.policy_resolved = True  # an explicit policy wins
        book.writer = None

    def flush_checkpoints(self, ring: RingView, final: bool = False) -> None:
        """Wait for the in-flight write; with ``final``, make the last commit durable."""
        book = self._book
        if book.policy is None or ring.rank != 0:
            return
        writer = self._rank0_writer(ring)
        # The agent gives a worker that says it is writing the final checkpoint
        # --final-checkpoint-timeout, not the moment it gives the others at the end.
        marker = ring.config.final_checkpoint_file if final else None
        if marker:
            _touch(marker)
        try:
            writer.flush()
            already_durable = book.durable_step == book.count and writer.last_error is None
            if final and not book.snapshot.empty and not already_durable:
                self._submit(writer, ring)
                writer.flush()
        finally:
            if marker:
                _remove(marker)

    def _resolve_policy(self, ring: RingView) -> None:
        """Take the policy from the worker's config once (on the first sync or commit)."""
        book = self._book
        if book.policy_resolved:
            return
        book.policy_resolved = True
        book.policy = checkpoint_policy(ring.config)

    def _rank0_writer(self, ring: RingView) -> DurableWriter:
        # Created only on rank 0, and only when first needed: a new writer removes
        # stale temporary directories, which must never be a live rank 0's write.
        book = self._book
        if book.writer is None:
            # Each write's outcome becomes an event for the agent's metrics (agent/metrics.py)
            # and the events file; the writer logs the outcome itself, so no second console line.
            events = ring.events
            report = lambda name, **fields: events.emit(name, console=False, **fields)  # noqa: E731
            book.writer = DurableWriter(book.policy, report=report, resumed_from=book.resumed_from)
        return book.writer

    def _submit(self, writer: DurableWriter, ring: RingView) -> None:
        """Write the last commit (the snapshot just taken) in the background; rank 0's
        writer publishes it only if ``ring``'s publish check still passes then."""
        book = self._book
        if writer.submit(
            book.snapshot.tree(),
            step=book.count,
            epoch=self._int_value("epoch"),
            round=ring.round,
            world_size=ring.world_size,
            still_current=ring.publish_check(),
        ):
            book.durable_step = book.count

    def _load(self, tree: dict, cuda_paths: frozenset = frozenset()) -> None:
        """Make the live state ``tree``'s, commit count included (``cuda_paths``: the
        tree's tensors that were CUDA tensors when committed)."""
        book = self._book
        book.cuda_paths = cuda_paths
        try:
            self.load_tree(tree)
        finally:
            book.cuda_paths = frozenset()
        if isinstance(tree.get(_COMMITS), int):
            book.count = tree[_COMMITS]
        if isinstance(tree.get(_COMMIT_ROUND), int):
            book.round = tree[_COMMIT_ROUND]

    def _take_durable_or_initial_state(self, ring: RingView) -> None:
        """The newest durable checkpoint, if any, else the live (initial) state, as the commit."""
        self._load_durable(ring)
        self._save(lambda: ring)

    def _load_durable(self, ring: RingView) -> None:
        book = self._book
        if book.policy is None:
            return
        directory = book.policy.directory
        try:
            # Checkpoints that exist but cannot be read now are retried, then fail the job
            # (exit 1: a retryable fault). Starting from the initial state instead would
            # lose them silently, and this run's writes would later bury them.
            found = load_latest(directory, skip_unreadable=book.policy.skip_unreadable)
        except CheckpointsUnreadable as exc:
            raise CheckpointsUnreadable(exc.directory, exc.unreadable, advice=UNREADABLE_ADVICE) from None
        # The directory's steps above this one are an earlier run's: this run's writer keeps them.
        book.resumed_from = -1 if found is None else int(found[1].get("step") or 0)
        if found is None:
            log.info("no durable checkpoint in %s: starting from the initial state", directory)
            return
        tree, manifest = found
        self._load(tree)
        step = int(manifest.get("step") or 0)
        # The manifest names the step; the round is the run's that wrote it, unless that is
        # later than ours (a new job id numbers rounds afresh): no commit may claim a round
        # after the current one.
        book.take(CommitId(min(int(manifest.get("round") or 0), ring.round), step))
        book.durable_step = step
        log.info("resumed from durable checkpoint step %s (epoch %s) in %s", step, manifest.get("epoch"), directory)

    def _int_value(self, name: str) -> Optional[int]:
        value = getattr(self, name, None) if name in self._book.value_names else None
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


def _rng_states() -> tuple:
    """(CPU generator state, CUDA generator state of the current device or None)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states: tuple) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class TorchState(State):
    """A model, its optimizer, an ``ElasticSampler``, plain values, and any keyword whose
    value has ``state_dict()``/``load_state_dict()``: a scheduler, a GradScaler, EMA
    weights (``elastic/stateful.py``)."""

    def __init__(self, model=None, optimizer=None, sampler=None, **values: Any):
        for name in values:
            if name in _RESERVED:
                raise ValueError(f"{name!r} is reserved by TorchState")
        objects = tuple(name for name, value in values.items() if is_stateful(value))
        for name, value in values.items():
            if name not in objects:
                check_plain("TorchState", name, value)  # refused now, not at the first commit
        super().__init__(**{name: value for name, value in values.items() if name not in objects})
        self._book.object_names = objects  # their state_dicts are checked at the first commit
        for name in objects:
            put(self, name, values[name])
        put(self, "model", model)
        put(self, "optimizer", optimizer)
        put(self, "sampler", sampler)

    def state_tree(self) -> dict:
        return self._tree(None)

    def commit_tree(self) -> dict:
        book = self._book
        book.live = live_tree(book.live, self.model, self.optimizer)
        return self._tree(book.live)

    def _tree(self, live: Optional[LiveTree]) -> dict:
        book = self._book
        tree = super().state_tree()
        if self.model is not None:
            tree["model"] = live.model_tree() if live is not None else self.model.state_dict()
        if self.optimizer is not None:
            tree["optimizer"] = live.optimizer_tree() if live is not None else self.optimizer.state_dict()
        if self.sampler is not None:
            tree["sampler"] = self.sampler.state_dict()
        if book.object_names:
            # Checked once: later commits cost the state_dict() calls and the copies only.
            get = (lambda name: getattr(self, name).state_dict()) if book.objects_checked \
                else (lambda name: state_of("TorchState", name, getattr(self, name)))
            tree[_OBJECTS] = {name: get(name) for name in book.object_names}
            book.objects_checked = True
        return tree

    def load_tree(self, tree: dict) -> None:
        super().load_tree(tree)
        if self.model is not None:
            self.model.load_state_dict(tree["model"])  # copies into the live parameters
        if self.optimizer is not None:
            # Copies, never the snapshot's buffers (the optimizer writes into its state).
            self.optimizer.load_state_dict(copy_into(tree["optimizer"], self.optimizer.state_dict()))
        if self.sampler is not None:
            self.sampler.load_state_dict(copy.deepcopy(tree["sampler"]))
        # After the optimizer: a scheduler's load leaves the optimizer's learning rate alone.
        saved = tree.get(_OBJECTS, {})
        cuda_paths = self._book.cuda_paths
        for name in self._book.object_names:
            if name not in saved:  # a durable checkpoint written before the object was added
                log.warning("the commit holds no state for %r: it keeps its own", name)
                continue
            place = (_OBJECTS, name)
            load_state(getattr(self, name), saved[name],
                       lambda value, live, place=place: copy_into(value, live, place, cuda_paths))

    def on_reset(self, ring: RingView) -> None:
        if self.sampler is not None and hasattr(self.sampler, "set_rank"):
            self.sampler.set_rank(ring.rank, ring.world_size)
            ring.follow_sampler(self.sampler)  # its counts go with the step records (step_log.py)
        super().on_reset(ring)
