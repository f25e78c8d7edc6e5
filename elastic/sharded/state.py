"""ShardedState: an FSDP2 model and optimizer that survive losing a host, re-sharded in-process.

    state = elastic.ShardedState(model=build, optimizer=lambda m: torch.optim.AdamW(m.parameters()),
                                 scheduler=lambda opt: StepLR(opt, 100), shard=shard, sampler=sampler, epoch=0)

``scheduler=`` is a factory of the optimizer, as the optimizer is of the module: both are
built anew on every ring, and the scheduler gets the commit's state_dict.

``commit()`` copies this worker's shards (parameters and the optimizer states shaped
like them, as the DTensors' local tensors) into its own slot, reused from commit to
commit, and posts copies of them to ``--shard-replicas`` other workers, on other hosts
where the ring has them (``placement.py``). The copies travel while the next step
trains; the next commit waits for what is left. A replica holder keeps the previous
complete copy until the new one has arrived whole, and an owner keeps its own copies of
the last three commits (the oldest goes once every rank is past the commit that made
it redundant), so at any moment every shard of some commit is held by the owner and
its replicas.

``sync()`` (after a loss, a join or a leave, and at the start) gathers what every rank
holds, agrees on the newest commit every shard of which some rank still holds
(``newest_covered``), builds the model on the meta device, shards it over the new ring
and gives it storage for its shards only, then moves each rank the element ranges of
its new shards straight into the live DTensors' local tensors (``plan_reshard``), from
its own copy where it holds one, else striped across the holders. Nothing is read
from disk. It ends by taking the commit again in the new layout; its copies travel
during the first step, and the old ring's copies stay until the first commit has seen
them arrive everywhere.

At the first start nobody holds anything: rank 0 builds ``model()`` whole and is the
only holder of a commit of a world of one; every rank takes its rows from it. With
``init=fn`` no worker builds the whole model: every rank builds it on the meta device,
shards it, and ``fn(module)`` initialises the local shards (e.g. with DTensor-aware
``torch.nn.init`` calls under a fixed seed).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..contract.console import FILE_ONLY
from ..contract.errors import ElasticError
from ..state import State, checkpoint_policy
from ..worker import fault_points
from ..worker.commit_gate import Verdict, act_on
from ..worker.lifecycle import current as _runtime
from ..worker.sync_plan import CommitId, SyncPlan
from . import durable, meta_wire, modules
from .mesh import device_mesh, device_type
from .placement import replica_holders, replicas_of
from .reshard_plan import Piece, newest_covered, plan_reshard
from .live_shards import live_shards, release_storage
from .slots import Replication, ShardSlot, slot_for

log = logging.getLogger(__name__)

_RESERVED = ("model", "optimizer", "scheduler", "sampler", "shard", "init")
_KEEP_METAS = 4  # (commit, world) metas kept: a rollback goes back one, a re-shard adds a layout


class ShardedState(State):
    """An FSDP2 model (built by ``model()``), its optimizer (``optimizer(module)``), a sampler
    and plain values, committed with in-memory replicas and re-sharded onto every new ring."""

    def __init__(self, model: Callable[[], torch.nn.Module], optimizer: Optional[Callable] = None,
                 shard: Optional[Callable] = None, sampler=None, init: Optional[Callable] = None,
                 scheduler: Optional[Callable] = None, **values: Any):
        for name in values:
            if name in _RESERVED:
                raise ValueError(f"{name!r} is reserved by ShardedState")
        if not callable(model):
            raise TypeError("ShardedState(model=...) takes a factory of the unsharded module, e.g. lambda: Net()")
        if scheduler is not None and (not callable(scheduler) or optimizer is None):
            raise TypeError("ShardedState(scheduler=...) takes a factory of the optimizer, e.g. "
                            "lambda opt: StepLR(opt, 100), and needs optimizer=")
        super().__init__(**values)
        # State's rank-0 writer is not used (_policy_resolved): ShardedCheckpoints with --checkpoint-dir (durable.py).
        for name, value in (("_policy_resolved", True), ("_durable", None), ("_durable_resolved", False),
                            ("_model_factory", model), ("_optimizer_factory", optimizer),
                            ("_shard", shard or modules.default_shard), ("_init", init),
                            ("_scheduler_factory", scheduler), ("scheduler", None),
                            ("model", None), ("optimizer", None), ("sampler", sampler),
                            ("_own", None), ("_own_older", []), ("_legacy", []), ("_confirm_ring", False),
                            ("_replicas", {}), ("_spares", {}), ("_metas", {}),
                            ("_replication", None), ("_holders", ()), ("_holders_for", None), ("_live", None),
                            ("_last_reshard_bytes", 0)):
            object.__setattr__(self, name, value)

    # -- commit ----------------------------------------------------------------
    def commit(self) -> None:
        """Snapshot this worker's shards and start their replication; raise HostsUpdatedInterrupt
        if the ring changes here (after the copies have arrived: the new ring needs them)."""
        runtime = _runtime()
        verdict = runtime.commit(lambda ticket: self._capture(runtime, ticket))
        if verdict is not Verdict.CONTINUE:
            self._finish_replication(None, raise_errors=True)
        act_on(verdict, self._commits)

    def _capture(self, runtime, ticket) -> int:
        self._await_copies()
        object.__setattr__(self, "_commits", self._commits + 1)
        object.__setattr__(self, "_commit_round", ticket.round)
        self._snapshot_and_replicate(runtime, wait=False)
        if self._commits >= 5:
            fault_points.sharded("replicating", runtime.rank)
        if self._durable is not None and self._durable.due(self._commits):
            self._write_durable(runtime)
        return self._commits

    def save(self) -> None:
        self._snapshot_and_replicate(_runtime(), wait=True)

    def restore(self) -> None:
        """After a failure: nothing to do until the new ring exists (``sync`` rebuilds the
        model from the commit); the live model belongs to the broken ring's mesh."""
        self._release_model()

    def _release_model(self) -> None:
        """The live model and optimizer go, with their memory (``release_storage``)."""
        if self.model is not None:
            release_storage(self.model, self.optimizer)
        for name in ("model", "optimizer", "scheduler", "_live"):
            object.__setattr__(self, name, None)
        for slot in self._held_slots():
            slot.forget_sources()

    @property
    def commit_id(self) -> Optional[CommitId]:
        return self._own.commit if self._own is not None else None

    def _snapshot_and_replicate(self, runtime, wait: bool) -> None:
        commit = CommitId(self._commit_round, self._commits)
        live = live_shards(self._live, self.model, self.optimizer)
        object.__setattr__(self, "_live", live)
        meta = modules.describe(commit, runtime.world_size, self.model, self.optimizer, live.tensors,
                                {name: getattr(self, name) for name in self._value_names}, self.sampler,
                                layout=live.layout, names=live.names)
        meta.scheduler = modules.scheduler_state(self.scheduler)
        # Own copies rotate through three slots: this commit, the last and the one before.
        # The one before goes only now: this rank passed the last commit's step with every
        # other (its collectives), and each of them waited at the last commit for its own
        # copies of the one before, so that one is complete everywhere. Overwriting it any
        # earlier could catch the ring, should a rank whose copy is still in flight die,
        # with neither of the two newest commits covered.
        older = self._own_older
        own = slot_for(older.pop(0) if len(older) == 2 else None, live.layout, runtime.world_size, runtime.rank)
        own.copy_from(live)
        own.commit = commit
        if self._own is not None:
            older.append(self._own)
        object.__setattr__(self, "_own", own)
        self._metas[(commit, runtime.world_size)] = meta  # one commit, two layouts while a re-shard settles
        for old in sorted(self._metas)[:-_KEEP_METAS]:
            del self._metas[old]
        if runtime.world_size == 1:
            return
        holders = self._placement(runtime)
        receive = {}
        for owner in replicas_of(holders, runtime.rank):
            receive[owner] = slot_for(self._spares.get(owner), live.layout, runtime.world_size, owner)
            self._spares[owner] = receive[owner]
        board = runtime.progress_board
        if board is not None:  # the agent's replica lag metric (agent/metrics.py)
            board.replica_posted(time.monotonic())
        done = (lambda: board.replica_done(time.monotonic())) if board is not None else None
        object.__setattr__(self, "_replication", Replication(commit, own, holders[runtime.rank], receive, done))
        if wait:
            self._finish_replication(None, raise_errors=True)

    def _await_copies(self) -> None:
        """Wait for this rank's copies of the last commit, sent and received. The first commit
        after a re-shard also says, in one small all-reduce, that every rank's are in: the
        old ring's copies of the commit (legacy) can go, the new ring's layout covers it."""
        self._finish_replication(None, raise_errors=True)
        if self._confirm_ring:
            # A host tensor: with cpu:gloo,cuda:nccl it travels over gloo, never a device sync.
            dist.all_reduce(torch.zeros(1))
            object.__setattr__(self, "_legacy", [])
            object.__setattr__(self, "_confirm_ring", False)

    def _finish_replication(self, timeout: Optional[float], raise_errors: bool = False) -> None:
        """Wait for the copies in flight; each one that arrived whole becomes the replica
        (its buffers swap with the older copy's, which the next copy arrives in)."""
        replication = self._replication
        if replication is None:
            return
        complete = replication.finish(timeout)
        for owner in replication.received:
            arrived = self._spares.pop(owner)
            older = self._replicas.get(owner)
            self._replicas[owner] = arrived
            if older is not None:
                self._spares[owner] = older
        if not complete and timeout is not None:
            # A receive still pending on a broken ring may yet write into its buffer: never reuse it.
            for owner in set(replication.receive) - replication.received:
                self._spares.pop(owner, None)
        object.__setattr__(self, "_replication", None)
        if raise_errors and replication.errors:
            raise replication.errors[0]

    def _placement(self, runtime) -> tuple[tuple[int, ...], ...]:
        """Who keeps copies of whose shards in this ring (the same for every commit of it)."""
        plan, count = runtime.plan, self._replica_count(runtime)
        cached = self._holders_for
        if cached is None or cached[0] is not plan or cached[1] != count:
            members = [slot.member_id for slot in plan.slots]
            object.__setattr__(self, "_holders", replica_holders(members, count))
            object.__setattr__(self, "_holders_for", (plan, count))
        return self._holders

    def _replica_count(self, runtime) -> int:
        config = runtime.config
        return int(getattr(config, "shard_replicas", 1) if config is not None else 1)

    # -- sync --------------------------------------------------------------------
    def sync(self) -> SyncPlan:
        """Make every rank of the new ring hold its shards of the newest commit every shard of
        which survived; returns who held and who received."""
        runtime = _runtime()
        started = time.monotonic()
        if not dist.is_initialized():
            raise ElasticError("ShardedState needs a process group: run the script with elastic-run")
        mesh = device_mesh()
        rank, world = runtime.rank, runtime.world_size
        checkpoints, group = self._checkpoints(runtime), None
        if checkpoints is not None:
            checkpoints.abandon()  # a write of the broken ring is never waited for
            group = checkpoints.group(runtime.round)
        slots, reports, held, worlds, chosen = self._agree_on_commit(runtime)
        newest = chosen[0] if chosen is not None else None
        first_start = newest is None and not worlds
        # Only the chosen commit's copies matter from here on: the others go before the new
        # model is built (a re-shard's peak memory), the chosen ones stay until the new ring
        # has replicated the commit in its layout (a loss during this re-shard finds them).
        slots = [s for s in slots if chosen is not None and (s.commit, s.world) == chosen]
        self._hold_only(slots)
        self._release_model()  # a planned switch's: the new one is built from the copies
        if newest is None:
            found = meta_wire.broadcast_found(durable.newest_for_resume(checkpoints.policy)
                                              if checkpoints is not None and rank == 0 else None, rank, runtime.backend)
            if checkpoints is not None:  # the directory's steps above it are an earlier run's
                checkpoints.resumed_from = int(found[1]["step"]) if found is not None else -1
            if not first_start:
                lost = max(worlds)[0]
                log.info("round %d: shards held (rank: (round, count, world, shard) ...): %s", runtime.round,
                         {r: rep[0] for r, rep in enumerate(reports)}, extra=FILE_ONLY)
                if found is None:
                    raise ElasticError(f"every copy of a shard of commit {lost.count} is lost (more hosts than "
                                       f"--shard-replicas covers) and there is no durable checkpoint")
                log.warning("round %d: every copy of a shard of commit %d is lost (more hosts than "
                            "--shard-replicas %d covers): resuming from durable checkpoint step %s in %s",
                            runtime.round, lost.count, self._replica_count(runtime), found[1]["step"], found[0])
            if found is not None:
                return self._resume_from_disk(runtime, mesh, group, found, started)
        sources: dict[int, ShardSlot] = {}
        if first_start:
            newest, meta = CommitId(0, 0), None
            if self._init is None and rank == 0:
                meta, sources[0] = self._whole_model_on_rank0(newest)
            holders = {0: [0]}
            meta = meta_wire.broadcast_meta(meta, 0, rank, runtime.round, runtime.backend)
        else:
            wanted = (newest.round, newest.count, chosen[1])
            source_rank = min(r for r, rep in enumerate(reports) if wanted in rep[1])
            meta = meta_wire.broadcast_meta(self._metas.get(chosen) if rank == source_rank else None, source_rank,
                                            rank, runtime.round, runtime.backend)
            holders: dict[int, list[int]] = {}
            for r, pairs in held.items():
                for key, shard in pairs:
                    if key == chosen:
                        holders.setdefault(shard, []).append(r)
            sources = {s.shard: s for s in slots if (s.commit, s.world) == chosen}
        model = self._build(runtime, mesh)
        if first_start and self._init is not None:
            self._init(model)
            pieces: list[Piece] = []
        else:
            pieces = plan_reshard(meta.layout, meta.world, holders, world)
        optimizer = self._optimizer_factory(model) if self._optimizer_factory is not None else None
        scheduler = self._scheduler_factory(optimizer) if self._scheduler_factory is not None else None
        states = modules.empty_optimizer_state(model, meta) if not first_start else {}
        targets = {f"model.{fqn}": p for fqn, p in model.named_parameters()}
        targets.update(states)
        moved = _run_pieces(pieces, rank, sources, {k: modules.local(t) for k, t in targets.items()},
                            lambda: runtime.round > 1 and fault_points.sharded("resharding", runtime.rank))
        self._load_meta(model, optimizer, meta, states, first_start)
        modules.load_scheduler(scheduler, meta.scheduler if meta is not None else None)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "_last_reshard_bytes", moved)
        # The commit again, in the new ring's layout. Its copies travel while the first step
        # trains, as any commit's: until they are in everywhere (the next commit waits for
        # that) the old ring's copies of it stay as legacy, so a loss meanwhile finds them.
        # At the first start there is nothing older to fall back on: the copies are awaited.
        del slots, sources
        object.__setattr__(self, "_commits", newest.count)
        object.__setattr__(self, "_commit_round", newest.round)
        self._snapshot_and_replicate(runtime, wait=first_start)
        object.__setattr__(self, "_confirm_ring", not first_start)  # every rank alike: a collective follows
        object.__setattr__(self, "_synced", True)
        seconds = time.monotonic() - started
        if meta is None:  # a first start with init=: no commit to re-shard, each rank initialised its own
            log.info("round %d: initialised the shards with init= (world %d) in %.3fs", runtime.round, world, seconds)
        else:
            log.info("round %d: re-sharded commit %d (world %d -> %d): received %.3f MB in %.3fs",
                     runtime.round, newest.count, meta.world, world, moved / 1e6, seconds)
        self._report_reshard(runtime, "start" if first_start else "memory", newest.count,
                             meta.world if meta is not None else 1, moved, seconds)
        holding_ranks = tuple(sorted({r for ranks in holders.values() for r in ranks}))
        return SyncPlan(newest, holding_ranks, tuple(r for r in range(world) if r not in holding_ranks), ())

    def _agree_on_commit(self, runtime):
        """Every rank's holdings, and the newest commit they cover. Copies still in flight when
        the ring broke are waited for (2 s at most, then asked again) only if their arrival
        would cover a newer commit: after a loss mid-step the pending copies are of a commit
        the dead rank never made, and waiting for them would only stall the re-shard."""
        for attempt in (0, 1):
            slots = self._held_slots()
            replication = self._replication
            pending = [(replication.commit.round, replication.commit.count, slot.world, owner)
                       for owner, slot in replication.receive.items() if owner not in replication.received
                       ] if replication is not None else []
            report = ([(s.commit.round, s.commit.count, s.world, s.shard) for s in slots],
                      [(c.round, c.count, w) for c, w in self._metas], pending)
            reports = meta_wire.gather_reports(report, runtime.world_size, runtime.round, runtime.backend)
            held = {r: [((CommitId(a, b), w), s) for a, b, w, s in rep[0]] for r, rep in enumerate(reports)}
            worlds = {(CommitId(a, b), w): w for rep in reports for a, b, w, _ in rep[0]}
            chosen = newest_covered(held, worlds)
            maybe = {r: held[r] + [((CommitId(a, b), w), s) for a, b, w, s in rep[2]] for r, rep in enumerate(reports)}
            worth_waiting = newest_covered(maybe, {**worlds, **{k: k[1] for pairs in maybe.values() for k, _ in pairs}})
            if attempt == 1 or worth_waiting == chosen:  # the same on every rank: it is gathered data
                self._finish_replication(timeout=0.0)  # what is still pending never counts
                return slots, reports, held, worlds, chosen
            self._finish_replication(timeout=2.0)

    def _resume_from_disk(self, runtime, mesh, group, found, started: float) -> SyncPlan:
        """Every rank loads its new shards of a durable checkpoint (any world size reads it)."""
        path, manifest = found
        model = self._build(runtime, mesh)
        optimizer = self._optimizer_factory(model)
        scheduler = self._scheduler_factory(optimizer) if self._scheduler_factory is not None else None
        saved = durable.load_into(path, model, optimizer, group)
        modules.load_scheduler(scheduler, saved.get("scheduler"))
        object.__setattr__(self, "scheduler", scheduler)
        for name, value in saved["values"].items():
            object.__setattr__(self, name, value)
        if self.sampler is not None and saved.get("sampler") is not None:
            self.sampler.load_state_dict(saved["sampler"])
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        self._hold_only([])
        object.__setattr__(self, "_commits", int(saved["commits"]))
        object.__setattr__(self, "_commit_round", runtime.round)  # newer than any commit a survivor may hold
        self._snapshot_and_replicate(runtime, wait=True)
        object.__setattr__(self, "_synced", True)
        seconds = time.monotonic() - started
        log.info("round %d: resumed from durable checkpoint step %s (world %s -> %d) in %.3fs", runtime.round,
                 manifest["step"], manifest.get("world_size"), runtime.world_size, seconds)
        self._report_reshard(runtime, "disk", self._commits, manifest.get("world_size"), 0, seconds)
        return SyncPlan(self.commit_id, (), tuple(range(runtime.world_size)), ())

    def _hold_only(self, slots: list[ShardSlot]) -> None:
        """Keep ``slots`` (as legacy, until the next commit is replicated) and nothing else."""
        object.__setattr__(self, "_own", None)
        object.__setattr__(self, "_own_older", [])
        object.__setattr__(self, "_confirm_ring", False)
        self._replicas.clear()
        self._spares.clear()
        object.__setattr__(self, "_legacy", list(slots))

    def _report_reshard(self, runtime, source: str, commit: int, from_world, received: int, seconds: float) -> None:
        """One ``resharded`` event per worker and re-shard, for the agent's metrics: what it
        received, and what keeping the new ring covered costs it per commit."""
        sends_to = self._holders[runtime.rank] if runtime.world_size > 1 and self._holders else ()
        worker = runtime.config.worker_id if runtime.config is not None else "local"
        shard_bytes = self._own.nbytes if self._own is not None else 0
        runtime.events.emit("resharded", console=False, worker=worker, source=source, commit=commit,
                            from_world=from_world, to_world=runtime.world_size, received_bytes=received,
                            seconds=round(seconds, 4), shard_bytes=shard_bytes,
                            replica_bytes_per_commit=shard_bytes * len(sends_to),
                            # per owner its replica, or the slot its copy is arriving in
                            replicas_held_bytes=sum(s.nbytes for s in {**self._replicas, **self._spares}.values()))

    # -- durable checkpoints ----------------------------------------------------------
    def _checkpoints(self, runtime) -> Optional[durable.ShardedCheckpoints]:
        if not self._durable_resolved:
            object.__setattr__(self, "_durable_resolved", True)
            policy = checkpoint_policy(runtime.config)
            if policy is not None:
                if self._optimizer_factory is None:
                    raise ElasticError("ShardedState writes durable checkpoints of a model and its optimizer: "
                                       "give optimizer=")
                object.__setattr__(self, "_durable", durable.ShardedCheckpoints(policy))
        return self._durable

    def _write_durable(self, runtime) -> None:
        values = {"values": {name: getattr(self, name) for name in self._value_names},
                  "sampler": self.sampler.state_dict() if self.sampler is not None else None,
                  "scheduler": modules.scheduler_state(self.scheduler), "commits": self._commits}
        self._durable.submit(self.model, self.optimizer, values, step=self._commits,
                             round_number=runtime.round, world=runtime.world_size,
                             still_current=runtime.durable_fence())
        object.__setattr__(self, "_durable_step", self._commits)

    def _build(self, runtime, mesh):
        device = torch.device(device_type(runtime.backend))
        return modules.build_sharded(self._model_factory, self._shard, mesh, device)

    def _held_slots(self) -> list[ShardSlot]:
        slots = [s for s in (self._own, *self._own_older) if s is not None and s.commit is not None]
        slots += [s for s in self._replicas.values() if s.commit is not None]
        # A spare with a commit is the replica an arrival just displaced, intact until the next
        # commit receives into it. It counts: a newer copy of one owner's shard does not make
        # the ring able to go on from the newer commit if another owner's never arrived.
        slots += [s for s in self._spares.values() if s.commit is not None]
        return slots + list(self._legacy)

    def _whole_model_on_rank0(self, commit: CommitId):
        """Rank 0's ``model()``, built whole, as shard 0 of a commit of a world of one."""
        whole = self._model_factory()
        tensors = {f"model.{fqn}": p for fqn, p in whole.named_parameters()}
        meta = modules.describe(commit, 1, whole, None, tensors,
                                {name: getattr(self, name) for name in self._value_names}, self.sampler)
        slot = ShardSlot(meta.layout, 1, 0)
        with torch.no_grad():
            for key, tensor in tensors.items():
                slot.view(key).copy_(tensor.detach().reshape(-1))
        slot.commit = commit
        return meta, slot

    def _load_meta(self, model, optimizer, meta, states, first_start: bool) -> None:
        if meta is None:  # a first start with init=: the module initialised itself
            return
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in meta.buffers:
                    buffer.copy_(meta.buffers[name])
        if optimizer is not None and not first_start:
            modules.load_optimizer(optimizer, model, meta, states)
        for name, value in meta.values.items():
            object.__setattr__(self, name, value)
        if self.sampler is not None and meta.sampler is not None:
            self.sampler.load_state_dict(meta.sampler)

    def on_reset(self) -> None:
        if self.sampler is not None and hasattr(self.sampler, "set_rank"):
            runtime = _runtime()
            self.sampler.set_rank(runtime.rank, runtime.world_size)
        super().on_reset()

    def flush_checkpoints(self, final: bool = False) -> None:
        """Every rank: wait for the copies and the write in flight; with ``final``, make the
        last commit durable (the live state is the last commit at the end of training)."""
        self._finish_replication(None)
        if self._durable is None:
            return
        self._durable.flush()
        if final and self._durable_step != self._commits and self.model is not None:
            self._write_durable(_runtime())
            self._durable.flush()


def _run_pieces(pieces: list[Piece], rank: int, sources: dict[int, ShardSlot], targets: dict[str, torch.Tensor],
                posted: Callable[[], object] = lambda: None) -> int:
    """Move this rank's pieces: local copies, then every send and receive posted at once.
    Tags count per (holder, receiver) pair in the plan's order, the same on both ends.
    Slots live in host memory and travel over the CPU backend: a piece for a GPU shard
    lands in a host buffer first and is copied to the device once everything arrived."""
    works, moved, counts, to_device = [], 0, {}, []
    with torch.no_grad():
        for piece in pieces:
            if rank not in (piece.holder, piece.receiver):
                continue
            pair = (piece.holder, piece.receiver)
            counts[pair] = tag = counts.get(pair, -1) + 1
            if piece.holder == rank:
                source = sources[piece.shard].view(piece.key).narrow(0, piece.src_start, piece.length)
            if piece.receiver == rank:
                target = targets[piece.key].view(-1).narrow(0, piece.dst_start, piece.length)
            if piece.holder == piece.receiver:
                target.copy_(source)
            elif piece.holder == rank:
                works.append(dist.isend(source, dst=piece.receiver, tag=tag))
            else:
                if target.device.type != "cpu":
                    to_device.append((target, torch.empty(piece.length, dtype=target.dtype)))
                    target = to_device[-1][1]
                works.append(dist.irecv(target, src=piece.holder, tag=tag))
                moved += target.numel() * target.element_size()
        posted()
        for work in works:
            work.wait()
        for target, staged in to_device:
            target.copy_(staged)
    return moved
