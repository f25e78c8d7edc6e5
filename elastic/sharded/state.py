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
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..contract.console import FILE_ONLY
from ..contract.errors import ElasticError
from ..commit_book import checkpoint_policy, values_of
from ..worker import fault_points
from ..worker import lifecycle
from ..worker.commit_gate import Verdict, act_on
from ..worker.ring_view import RingView
from ..worker.sync_plan import CommitId, SyncPlan
from . import durable, meta_wire, modules, resume_check
from .book import ShardBook
from .mesh import device_mesh, device_type
from .placement import replica_holders, replicas_of
from .pieces import run_pieces
from .reshard_plan import Piece, newest_covered, plan_reshard
from .live_shards import live_shards, free_storage
from .slots import Replication, ShardSlot, slot_for

log = logging.getLogger(__name__)

_RESERVED = ("model", "optimizer", "scheduler", "sampler", "shard", "init")
_KEEP_METAS = 4  # (commit, world) metas kept: a rollback goes back one, a re-shard adds a layout


class ShardedState:
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
        # The one private attribute: the user's names are the rest (elastic/commit_book.py).
        self._book = ShardBook(value_names=tuple(values), model_factory=model, optimizer_factory=optimizer,
                               shard=shard or modules.default_shard, init=init, scheduler_factory=scheduler)
        for name, value in values.items():
            setattr(self, name, value)
        self.model, self.optimizer, self.scheduler, self.sampler = None, None, None, sampler

    # -- commit ----------------------------------------------------------------
    @staticmethod
    def _ring_now() -> RingView:
        """The ring this worker trains on now (``commit()`` and ``data_share`` take none):
        the process is asked here, and only here."""
        return lifecycle.ring()

    def commit(self) -> None:
        """Snapshot this worker's shards and start their replication; raise HostsUpdatedInterrupt
        if the ring changes here (after the copies have arrived: the new ring needs them)."""
        verdict = self._ring_now().commit(self._capture)
        self._after_gate(verdict)
        act_on(verdict, self._book.count)

    def _after_gate(self, verdict: Verdict) -> None:
        """Between the ring's verdict and acting on it: a ring that changes needs the copies."""
        if verdict is not Verdict.CONTINUE:
            self._finish_replication(None, raise_errors=True)

    def _capture(self, ring: RingView) -> int:
        book = self._book
        self._await_copies()
        book.next_commit(ring.round)
        self._snapshot_and_replicate(ring, wait=False)
        fault_points.sharded("replicating", ring.rank, commit=book.count, round_number=ring.round)
        if book.durable is not None and book.durable.due(book.count):
            self._write_durable(ring)
        return book.count

    def restore(self) -> None:
        """After a failure: nothing to do until the new ring exists (``sync`` rebuilds the
        model from the commit); the live model belongs to the broken ring's mesh."""
        self._free_model()

    def _free_model(self) -> None:
        """The live model and optimizer go, with their memory (``free_storage``)."""
        if self.model is not None:
            free_storage(self.model, self.optimizer)
        self.model, self.optimizer, self.scheduler = None, None, None
        self._book.live = None
        for slot in self._held_slots():
            slot.forget_sources()

    @property
    def commit_id(self) -> Optional[CommitId]:
        return self._book.own.commit if self._book.own is not None else None

    def _snapshot_and_replicate(self, ring: RingView, wait: bool) -> None:
        book = self._book
        commit = CommitId(book.round, book.count)
        live = live_shards(book.live, self.model, self.optimizer)
        book.live = live
        meta = modules.describe(commit, ring.world_size, self.model, self.optimizer, live.tensors,
                                values_of(self, book), self.sampler,
                                layout=live.layout, names=live.names)
        meta.scheduler = modules.scheduler_state(self.scheduler)
        # Own copies rotate through three slots: this commit, the last and the one before.
        # The one before goes only now: this rank passed the last commit's step with every
        # other (its collectives), and each of them waited at the last commit for its own
        # copies of the one before, so that one is complete everywhere. Overwriting it any
        # earlier could catch the ring, should a rank whose copy is still in flight die,
        # with neither of the two newest commits covered.
        older = book.own_older
        own = slot_for(older.pop(0) if len(older) == 2 else None, live.layout, ring.world_size, ring.rank)
        own.copy_from(live)
        own.commit = commit
        if book.own is not None:
            older.append(book.own)
        book.own = own
        book.metas[(commit, ring.world_size)] = meta  # one commit, two layouts while a re-shard settles
        for old in sorted(book.metas)[:-_KEEP_METAS]:
            del book.metas[old]
        if ring.world_size == 1:
            return
        holders = self._placement(ring)
        receive = {}
        for owner in replicas_of(holders, ring.rank):
            receive[owner] = slot_for(book.spares.get(owner), live.layout, ring.world_size, owner)
            book.spares[owner] = receive[owner]
        board = ring.progress_board
        if board is not None:  # the agent's replica lag metric (agent/metrics.py)
            board.replica_posted(time.monotonic())
        done = (lambda: board.replica_done(time.monotonic())) if board is not None else None
        book.replication = Replication(commit, own, holders[ring.rank], receive, done)
        if wait:
            self._finish_replication(None, raise_errors=True)

    def _await_copies(self) -> None:
        """Wait for this rank's copies of the last commit, sent and received. The first commit
        after a re-shard also says, in one small all-reduce, that every rank's are in: the
        old ring's copies of the commit (legacy) can go, the new ring's layout covers it."""
        book = self._book
        self._finish_replication(None, raise_errors=True)
        if book.confirm_ring:
            # A host tensor: with cpu:gloo,cuda:nccl it travels over gloo, never a device sync.
            dist.all_reduce(torch.zeros(1))
            book.legacy = []
            book.confirm_ring = False

    def _finish_replication(self, timeout: Optional[float], raise_errors: bool = False) -> None:
        """Wait for the copies in flight; each one that arrived whole becomes the replica
        (its buffers swap with the older copy's, which the next copy arrives in)."""
        book = self._book
        replication = book.replication
        if replication is None:
            return
        complete = replication.finish(timeout)
        for owner in replication.received:
            arrived = book.spares.pop(owner)
            older = book.replicas.get(owner)
            book.replicas[owner] = arrived
            if older is not None:
                book.spares[owner] = older
        if not complete and timeout is not None:
            # A receive still pending on a broken ring may yet write into its buffer: never reuse it.
            for owner in set(replication.receive) - replication.received:
                book.spares.pop(owner, None)
        book.replication = None
        if raise_errors and replication.errors:
            raise replication.errors[0]

    def _placement(self, ring: RingView) -> tuple[tuple[int, ...], ...]:
        """Who keeps copies of whose shards in this ring (the same for every commit of it)."""
        book = self._book
        plan, count = ring.plan, self._replica_count(ring)
        cached = book.holders_for
        if cached is None or cached[0] is not plan or cached[1] != count:
            members = [slot.member_id for slot in plan.slots]
            book.holders = replica_holders(members, count)
            book.holders_for = (plan, count)
        return book.holders

    def _replica_count(self, ring: RingView) -> int:
        return ring.config.shard_replicas

    # -- sync --------------------------------------------------------------------
    def sync(self, ring: RingView) -> SyncPlan:
        """Make every rank of ``ring`` hold its shards of the newest commit every shard of
        which survived; returns who held and who received."""
        book = self._book
        started = time.monotonic()
        if not dist.is_initialized():
            raise ElasticError("ShardedState needs a process group: run the script with elastic-run")
        mesh = device_mesh()
        rank, world = ring.rank, ring.world_size
        checkpoints, group = self._checkpoints(ring), None
        if checkpoints is not None:
            checkpoints.abandon()  # a write of the broken ring is never waited for
            group = checkpoints.group(ring.round)
        slots, reports, held, worlds, chosen = self._agree_on_commit(ring)
        newest = chosen[0] if chosen is not None else None
        first_start = newest is None and not worlds
        # Only the chosen commit's copies matter from here on: the others go before the new
        # model is built (a re-shard's peak memory), the chosen ones stay until the new ring
        # has replicated the commit in its layout (a loss during this re-shard finds them).
        slots = [s for s in slots if chosen is not None and (s.commit, s.world) == chosen]
        self._hold_only(slots)
        self._free_model()  # a planned switch's: the new one is built from the copies
        if newest is None:
            if not first_start:
                log.info("round %d: shards held (rank: (round, count, world, shard) ...): %s", ring.round,
                         {r: rep[0] for r, rep in enumerate(reports)}, extra=FILE_ONLY)
            lost = None if first_start else (f"every copy of a shard of commit {max(worlds)[0].count} is lost (more "
                                              f"hosts than --shard-replicas {self._replica_count(ring)} covers)")
            resumed = resume_check.resume_from_newest(
                ring, checkpoints, lambda found: self._resume_from_disk(ring, mesh, group, found, started), lost=lost)
            if resumed is not None:
                return resumed
        sources: dict[int, ShardSlot] = {}
        if first_start:
            newest, meta = CommitId(0, 0), None
            if book.init is None and rank == 0:
                meta, sources[0] = self._whole_model_on_rank0(newest)
            holders = {0: [0]}
            meta = meta_wire.broadcast_meta(meta, 0, rank, ring.round, ring.backend)
        else:
            wanted = (newest.round, newest.count, chosen[1])
            source_rank = min(r for r, rep in enumerate(reports) if wanted in rep[1])
            meta = meta_wire.broadcast_meta(book.metas.get(chosen) if rank == source_rank else None, source_rank,
                                            rank, ring.round, ring.backend)
            holders: dict[int, list[int]] = {}
            for r, pairs in held.items():
                for key, shard in pairs:
                    if key == chosen:
                        holders.setdefault(shard, []).append(r)
            sources = {s.shard: s for s in slots if (s.commit, s.world) == chosen}
        model = self._build(ring, mesh)
        if first_start and book.init is not None:
            book.init(model)
            pieces: list[Piece] = []
        else:
            pieces = plan_reshard(meta.layout, meta.world, holders, world)
        optimizer = book.optimizer_factory(model) if book.optimizer_factory is not None else None
        scheduler = book.scheduler_factory(optimizer) if book.scheduler_factory is not None else None
        states = modules.empty_optimizer_state(model, meta) if not first_start else {}
        targets = {f"model.{fqn}": p for fqn, p in model.named_parameters()}
        targets.update(states)
        moved = run_pieces(pieces, rank, sources, {k: modules.local(t) for k, t in targets.items()},
                            lambda: fault_points.sharded("resharding", ring.rank, commit=newest.count,
                                                         round_number=ring.round))
        self._load_meta(model, optimizer, meta, states, first_start)
        modules.load_scheduler(scheduler, meta.scheduler if meta is not None else None)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        book.last_reshard_bytes = moved
        # The commit again, in the new ring's layout. Its copies travel while the first step
        # trains, as any commit's: until they are in everywhere (the next commit waits for
        # that) the old ring's copies of it stay as legacy, so a loss meanwhile finds them.
        # At the first start there is nothing older to fall back on: the copies are awaited.
        del slots, sources
        book.take(newest)
        self._snapshot_and_replicate(ring, wait=first_start)
        book.confirm_ring = not first_start  # every rank alike: a collective follows
        book.synced = True
        seconds = time.monotonic() - started
        if meta is None:  # a first start with init=: no commit to re-shard, each rank initialised its own
            log.info("round %d: initialised the shards with init= (world %d) in %.3fs", ring.round, world, seconds)
        else:
            log.info("round %d: re-sharded commit %d (world %d -> %d): received %.3f MB in %.3fs",
                     ring.round, newest.count, meta.world, world, moved / 1e6, seconds)
        self._report_reshard(ring, "start" if first_start else "memory", newest.count,
                             meta.world if meta is not None else 1, moved, seconds)
        holding_ranks = tuple(sorted({r for ranks in holders.values() for r in ranks}))
        return SyncPlan(newest, holding_ranks, tuple(r for r in range(world) if r not in holding_ranks), ())

    def _agree_on_commit(self, ring: RingView):
        """Every rank's holdings, and the newest commit they cover. Copies still in flight when
        the ring broke are waited for (2 s at most, then asked again) only if their arrival
        would cover a newer commit: after a loss mid-step the pending copies are of a commit
        the dead rank never made, and waiting for them would only stall the re-shard."""
        for attempt in (0, 1):
            slots = self._held_slots()
            replication = self._book.replication
            pending = [(replication.commit.round, replication.commit.count, slot.world, owner)
                       for owner, slot in replication.receive.items() if owner not in replication.received
                       ] if replication is not None else []
            report = ([(s.commit.round, s.commit.count, s.world, s.shard) for s in slots],
                      [(c.round, c.count, w) for c, w in self._book.metas], pending)
            reports = meta_wire.gather_reports(report, ring.world_size, ring.round, ring.backend)
            held = {r: [((CommitId(a, b), w), s) for a, b, w, s in rep[0]] for r, rep in enumerate(reports)}
            worlds = {(CommitId(a, b), w): w for rep in reports for a, b, w, _ in rep[0]}
            chosen = newest_covered(held, worlds)
            maybe = {r: held[r] + [((CommitId(a, b), w), s) for a, b, w, s in rep[2]] for r, rep in enumerate(reports)}
            worth_waiting = newest_covered(maybe, {**worlds, **{k: k[1] for pairs in maybe.values() for k, _ in pairs}})
            if attempt == 1 or worth_waiting == chosen:  # the same on every rank: it is gathered data
                self._finish_replication(timeout=0.0)  # what is still pending never counts
                return slots, reports, held, worlds, chosen
            self._finish_replication(timeout=2.0)

    def _resume_from_disk(self, ring: RingView, mesh, group, found, started: float) -> Optional[SyncPlan]:
        """Every rank loads its new shards of a durable checkpoint (any world size reads it);
        None, on every rank, when its checksums do not verify (``resume_check.load_verified``)."""
        book = self._book
        path, manifest = found
        model = self._build(ring, mesh)
        optimizer = book.optimizer_factory(model)
        scheduler = book.scheduler_factory(optimizer) if book.scheduler_factory is not None else None
        verified, saved = resume_check.load_verified(ring, found, lambda: durable.load_into(path, model, optimizer, group),
                                                book.durable.policy.skip_unreadable)
        if not verified:  # not this one: its memory goes before an older one's model is built
            free_storage(model, optimizer)
            return None
        modules.load_scheduler(scheduler, saved.get("scheduler"))
        self.scheduler = scheduler
        for name, value in saved["values"].items():
            setattr(self, name, value)
        if self.sampler is not None and saved.get("sampler") is not None:
            self.sampler.load_state_dict(saved["sampler"])
        self.model = model
        self.optimizer = optimizer
        self._hold_only([])
        book.count = int(saved["commits"])
        book.round = ring.round  # newer than any commit a survivor may hold
        self._snapshot_and_replicate(ring, wait=True)
        book.synced = True
        seconds = time.monotonic() - started
        log.info("round %d: resumed from durable checkpoint step %s (world %s -> %d) in %.3fs", ring.round,
                 manifest["step"], manifest.get("world_size"), ring.world_size, seconds)
        self._report_reshard(ring, "disk", book.count, manifest.get("world_size"), 0, seconds)
        return SyncPlan(self.commit_id, (), tuple(range(ring.world_size)), ())

    def _hold_only(self, slots: list[ShardSlot]) -> None:
        """Keep ``slots`` (as legacy, until the next commit is replicated) and nothing else."""
        book = self._book
        book.own = None
        book.own_older = []
        book.confirm_ring = False
        book.replicas.clear()
        book.spares.clear()
        book.legacy = list(slots)

    def _report_reshard(self, ring: RingView, source: str, commit: int, from_world, received: int, seconds: float) -> None:
        """One ``resharded`` event per worker and re-shard, for the agent's metrics: what it
        received, and what keeping the new ring covered costs it per commit."""
        book = self._book
        sends_to = book.holders[ring.rank] if ring.world_size > 1 and book.holders else ()
        worker = ring.config.worker_id
        shard_bytes = book.own.nbytes if book.own is not None else 0
        ring.events.emit("resharded", console=False, worker=worker, source=source, commit=commit,
                            from_world=from_world, to_world=ring.world_size, received_bytes=received,
                            seconds=round(seconds, 4), shard_bytes=shard_bytes,
                            replica_bytes_per_commit=shard_bytes * len(sends_to),
                            # per owner its replica, or the slot its copy is arriving in
                            replicas_held_bytes=sum(s.nbytes for s in {**book.replicas, **book.spares}.values()))

    # -- durable checkpoints ----------------------------------------------------------
    def _checkpoints(self, ring: RingView) -> Optional[durable.ShardedCheckpoints]:
        book = self._book
        if not book.durable_resolved:
            book.durable_resolved = True
            policy = checkpoint_policy(ring.config)
            if policy is not None:
                if book.optimizer_factory is None:
                    raise ElasticError("ShardedState writes durable checkpoints of a model and its optimizer: "
                                       "give optimizer=")
                book.durable = durable.ShardedCheckpoints(policy)
        return book.durable

    def _write_durable(self, ring: RingView) -> None:
        book = self._book
        values = {"values": values_of(self, book),
                  "sampler": self.sampler.state_dict() if self.sampler is not None else None,
                  "scheduler": modules.scheduler_state(self.scheduler), "commits": book.count}
        book.durable.submit(self.model, self.optimizer, values, step=book.count,
                             round_number=ring.round, world=ring.world_size,
                             still_current=ring.publish_check())
        book.durable_step = book.count

    def _build(self, ring: RingView, mesh):
        device = torch.device(device_type(ring.backend))
        return modules.build_sharded(self._book.model_factory, self._book.shard, mesh, device)

    def _held_slots(self) -> list[ShardSlot]:
        book = self._book
        slots = [s for s in (book.own, *book.own_older) if s is not None and s.commit is not None]
        slots += [s for s in book.replicas.values() if s.commit is not None]
        # A spare with a commit is the replica an arrival just displaced, intact until the next
        # commit receives into it. It counts: a newer copy of one owner's shard does not make
        # the ring able to go on from the newer commit if another owner's never arrived.
        slots += [s for s in book.spares.values() if s.commit is not None]
        return slots + list(book.legacy)

    def _whole_model_on_rank0(self, commit: CommitId):
        """Rank 0's ``model()``, built whole, as shard 0 of a commit of a world of one."""
        whole = self._book.model_factory()
        tensors = {f"model.{fqn}": p for fqn, p in whole.named_parameters()}
        meta = modules.describe(commit, 1, whole, None, tensors,
                                values_of(self, self._book), self.sampler)
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
            setattr(self, name, value)
        if self.sampler is not None and meta.sampler is not None:
            self.sampler.load_state_dict(meta.sampler)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call these after every re-formation, on every worker of the new ring, once the
        state is re-sharded; not when the job starts."""
        self._book.add_reset_callbacks(callbacks)

    def on_reset(self, ring: RingView) -> None:
        if self.sampler is not None and hasattr(self.sampler, "set_rank"):
            self.sampler.set_rank(ring.rank, ring.world_size)
        self._book.run_reset_callbacks()

    def flush_checkpoints(self, ring: RingView, final: bool = False) -> None:
        """Every rank: wait for the copies and the write in flight; with ``final``, make the
        last commit durable (the live state is the last commit at the end of training)."""
        book = self._book
        self._finish_replication(None)
        if book.durable is None:
            return
        book.durable.flush()
        if final and book.durable_step != book.count and self.model is not None:
            self._write_durable(ring)
            book.durable.flush()
