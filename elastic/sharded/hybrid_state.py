"""HybridShardedState: hybrid sharding (HSDP) whose unit of elasticity is a complete replica group.

    state = elastic.HybridShardedState(model=build, optimizer=..., scheduler=..., shard=shard,
                                       shard_size=2, sampler=sampler, step=0)

Each round the ring is cut into replica groups of ``shard_size`` workers (times
``tensor_parallel``) on one host each (``hybrid_plan.plan_mesh``); ``shard(module, mesh)``
gets a ("replicate", "shard") mesh (or ("replicate", "shard", "tp")), on which
``fully_shard`` is HSDP. A commit copies this worker's shards into a slot in its own
memory and sends nothing: the replicas of a shard are the same coordinate's shards in
the other groups, identical at every commit (they applied the same all-reduced step).

After a loss the complete groups go on with one replica fewer: each worker builds the
model on the new mesh and copies its own slot into it (no re-shard, nothing over the
network, nothing from disk); the survivors of a broken group wait as spares
(``spares.py``) and keep their slots. A replacement or a joining host completes a group
at a commit (a planned switch, nothing rolled back): the group's workers take the slots
of their coordinates from the healthy replicas (``plan_refill``, striped across them).
With fewer than ``min_groups`` complete groups the ring falls back to ``ShardedState``'s
1-D path (every worker trains, re-sharded from the groups' slots, replicas per
``--shard-replicas``); when every copy of a shard is gone, the newest durable (DCP)
checkpoint, at any mesh shape.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..commit_book import values_of
from ..contract.console import FILE_ONLY
from ..contract.errors import ElasticError, PeerDataInvalid
from ..worker import wire
from ..worker.commit_gate import Verdict
from ..worker.ring_view import RingView
from ..worker.state_transfer import wire_device
from ..worker.sync_plan import CommitId, SyncPlan
from . import durable, meta_wire, modules, resume_check
from ..worker.ring_abort import socket_snapshot
from .hybrid_mesh import adopt_connections, build_mesh, default_shard_size, remember, round_facts
from .hybrid_plan import FLAT, NONE, HybridShape, MeshPlan, data_share, plan_mesh
from .hybrid_refill import finish_refill, group_slot, local_layout, post_refill
from .live_shards import free_storage, live_shards
from .mesh import device_type
from .pieces import run_pieces
from .reshard_plan import plan_reshard
from .slots import ShardSlot
from .spares import SpareTicks, wait_as_spare
from .state import _KEEP_METAS, ShardedState

log = logging.getLogger(__name__)

_MAX_REPORT_BYTES = 4 << 20


@dataclass
class HybridBook:
    """A ``HybridShardedState``'s own bookkeeping, beside the ``ShardBook``."""

    requested: Optional[int]  # shard_size as given (None: a host's local world size)
    tensor_parallel: int
    min_groups: int
    shape: Optional[HybridShape] = None  # agreed at the first sync, then fixed
    plan: Optional[MeshPlan] = None  # this round's
    group: Optional[tuple[str, ...]] = None  # the worker ids of this worker's group, in coordinate order
    coordinate: int = 0
    ticks: Optional[SpareTicks] = None  # the lead's, while the round has spares
    stopping: bool = False
    last: dict = field(default_factory=dict)  # the last sync's figures (benchmarks)

    @property
    def hybrid(self) -> bool:
        return self.plan is not None and self.plan.mode not in (FLAT, NONE)


def warm_up() -> None:
    """Import what the first sync uses, now. A joiner builds its state before it enters the
    ring, and its first sync is on the running groups' path: they wait for it in the
    refill. Measured under load 20: importing FSDP2 took 5.4 s, and the first
    ``fully_shard`` of a process another 4.9 s, importing ``torch._dynamo`` (its
    ``DTensor.from_local`` is wrapped in ``torch._disable_dynamo``, which imports it on the
    first call); both were the whole of a 20 MB refill's stall."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401


class HybridShardedState(ShardedState):
    """A ``ShardedState`` on a hybrid mesh: replica groups of ``shard_size`` workers (module docstring)."""

    def __init__(self, model: Callable[[], torch.nn.Module], optimizer: Optional[Callable] = None,
                 shard: Optional[Callable] = None, sampler=None, init: Optional[Callable] = None,
                 scheduler: Optional[Callable] = None, *, shard_size: Optional[int] = None,
                 tensor_parallel: int = 1, min_groups: int = 2, **values: Any):
        super().__init__(model, optimizer, shard, sampler, init, scheduler, **values)
        if shard_size is not None:
            HybridShape(shard_size, tensor_parallel, min_groups)  # a clear error now, not at the first sync
        if tensor_parallel > 1 and shard is None:
            raise TypeError("HybridShardedState(tensor_parallel=...) needs shard=: the tensor-parallel plan is yours")
        self._hybrid = HybridBook(shard_size, tensor_parallel, min_groups)
        warm_up()


    # -- what the user reads --------------------------------------------------------
    @property
    def data_share(self) -> Optional[tuple[int, int]]:
        """(index, count): this worker trains on rows ``index::count`` of every global batch
        (tensor-parallel peers share one); None on a spare."""
        return self._share(self._ring_now())

    def _share(self, ring: RingView) -> Optional[tuple[int, int]]:
        hyb = self._hybrid
        if hyb.plan is None:
            return ring.rank, ring.world_size
        return data_share(hyb.plan, ring.rank)

    @property
    def mesh_plan(self) -> Optional[MeshPlan]:
        """This round's groups and spares (``hybrid_plan.MeshPlan``)."""
        return self._hybrid.plan

    # -- commit -------------------------------------------------------------------
    def _after_gate(self, verdict: Verdict) -> None:
        hyb = self._hybrid
        if hyb.ticks is not None:
            hyb.ticks.answered()  # rank 0 may be a spare: its switch decision is made (spares.py)
        super()._after_gate(verdict)
        if verdict is Verdict.STOP:
            hyb.stopping = True  # the spares stop at this commit by themselves

    def _capture(self, ring: RingView) -> int:
        count = super()._capture(ring)
        if self._hybrid.ticks is not None:
            self._hybrid.ticks.post(count)  # before the gate's exchange, which the spares join
        return count

    def _snapshot_and_replicate(self, ring, wait: bool) -> None:
        hyb = self._hybrid
        if not hyb.hybrid:
            return super()._snapshot_and_replicate(ring, wait)
        # The replicas are the other groups' same coordinates: a copy in this worker's memory
        # is the whole commit. Two own slots: this commit and the last (a loss mid-commit
        # finds every coordinate of one of the two, modules docstring of hybrid_plan).
        book = self._book
        commit = CommitId(book.round, book.count)
        live = live_shards(book.live, self.model, self.optimizer)
        book.live = live
        world = hyb.shape.group_size
        meta = modules.describe(commit, world, self.model, self.optimizer, live.tensors, values_of(self, book),
                                self.sampler, layout=live.layout, names=live.names)
        meta.scheduler = modules.scheduler_state(self.scheduler)
        older = book.own_older
        local = local_layout(live.tensors, live.tensors)
        own = group_slot(older.pop(0) if older else None, local, world, hyb.coordinate)
        own.copy_from(live)
        own.commit = commit
        if book.own is not None:
            older.append(book.own)
        book.own = own
        book.legacy = []  # the commit before the mesh changed: every coordinate is held in the new one now
        book.metas[(commit, world)] = meta
        for old in sorted(book.metas)[:-_KEEP_METAS]:
            del book.metas[old]

    # -- sync ---------------------------------------------------------------------
    def sync(self, ring: RingView) -> SyncPlan:
        if not dist.is_initialized():
            raise ElasticError("HybridShardedState needs a process group: run the script with elastic-run")
        hyb = self._hybrid
        started = time.monotonic()
        facts = round_facts(ring)
        hyb.ticks, hyb.stopping = None, False
        reports = self._gather_groups(facts)
        if hyb.shape is None:
            agreed = [r["shard_size"] for r in reports if r["shard_size"] is not None]
            size = agreed[0] if agreed else hyb.requested or default_shard_size(facts.hosts) // hyb.tensor_parallel
            hyb.shape = HybridShape(max(1, size), hyb.tensor_parallel, hyb.min_groups)
        previous = {facts.workers[r]: tuple(rep["group"]) for r, rep in enumerate(reports) if rep["group"]}
        plan = plan_mesh(facts.workers, facts.hosts, previous, hyb.shape)
        hyb.plan = plan
        log.info("round %d: %s", facts.round, plan.describe())
        if plan.mode == NONE:
            raise ElasticError(f"round {facts.round}: no complete group of {hyb.shape.group_size} workers on one host "
                               f"is left, and a tensor-parallel model cannot be re-sharded over a 1-D ring")
        if plan.mode == FLAT:
            hyb.group = None
            remember(facts.round, plan, None)
            return super().sync(ring)
        place = plan.place(facts.rank)
        hyb.group = tuple(facts.workers[r] for r in plan.groups[place[0]]) if place else hyb.group
        hyb.coordinate = place[1] if place else hyb.coordinate
        return self._sync_hybrid(ring, facts, plan, reports, started)

    def _gather_groups(self, facts) -> list[dict]:
        """Every rank's group of the last round, the job's shard size and the sizes of the
        slots it holds (one small all_gather, checked)."""
        book, hyb = self._book, self._hybrid
        sizes = [[s.commit.round, s.commit.count, s.world, s.shard, {d: b.numel() for d, b in s.flat.items()}]
                 for s in self._held_slots()]
        mine = {"group": list(hyb.group) if hyb.group else None,
                "shard_size": hyb.shape.shard_size if hyb.shape is not None else None, "sizes": sizes}
        bodies = wire.all_gather_bytes(wire.dumps(mine), facts.world_size, wire_device(facts.backend),
                                       "hybrid report", _MAX_REPORT_BYTES)
        reports = []
        for rank, body in enumerate(bodies):
            what = f"hybrid report of rank {rank}"
            value = wire.loads(body, what, limit=_MAX_REPORT_BYTES)
            if type(value) is not dict or set(value) != {"group", "shard_size", "sizes"}:
                raise PeerDataInvalid(f"{what}: expected group, shard_size and sizes")
            group, size = value["group"], value["shard_size"]
            if group is not None and (type(group) is not list or any(type(w) is not str for w in group)):
                raise PeerDataInvalid(f"{what}: a group is a list of worker ids")
            if size is not None and (type(size) is not int or size < 1):
                raise PeerDataInvalid(f"{what}: shard_size must be a positive count")
            for entry in value["sizes"] if type(value["sizes"]) is list else [None]:
                if (type(entry) is not list or len(entry) != 5 or any(type(v) is not int or v < 0 for v in entry[:4])
                        or type(entry[4]) is not dict or any(type(n) is not int or n < 0 for n in entry[4].values())):
                    raise PeerDataInvalid(f"{what}: a slot's sizes are [round, count, world, shard, {{dtype: n}}]")
            reports.append(value)
        return reports

    def _sync_hybrid(self, ring, facts, plan: MeshPlan, reports: list[dict], started: float) -> SyncPlan:
        book, hyb = self._book, self._hybrid
        rank = facts.rank
        trains = plan.trains(rank)
        checkpoints, group = self._checkpoints(ring), None
        before = socket_snapshot()
        if checkpoints is not None:
            checkpoints.abandon()
            group = checkpoints.group(facts.round, ranks=plan.training)
        book.holders, book.holders_for = (), None  # the 1-D path's replica placement: none here
        mesh = build_mesh(plan, rank, device_type(facts.backend))
        # The mesh's lines are groups of their own: a loss must wake their collectives too.
        adopt_connections(ring, before)
        remember(facts.round, plan, mesh)
        built = time.monotonic()
        slots, held_reports, held, worlds, chosen = self._agree_on_commit(ring)
        agreed = time.monotonic()
        newest = chosen[0] if chosen is not None else None
        first_start = newest is None and not worlds
        slots = [s for s in slots if chosen is not None and (s.commit, s.world) == chosen]
        self._hold_only(slots)
        self._free_model()
        if newest is None:
            lost = None if first_start else (f"every copy of a shard of commit {max(worlds)[0].count} is lost "
                                              "(every replica group holding it)")
            resumed = resume_check.resume_from_newest(
                ring, checkpoints, lambda found: self._resume_from_disk_hybrid(ring, facts, plan, mesh, group, found,
                                                                               started), lost=lost)
            if resumed is not None:
                return resumed
        sources: dict[int, ShardSlot] = {}
        if first_start:
            newest, meta, holders = CommitId(0, 0), None, {0: [0]}
            if book.init is None and rank == 0 and hyb.shape.tensor_parallel == 1:
                meta, sources[0] = self._whole_model_on_rank0(newest)
            if book.init is None and hyb.shape.tensor_parallel > 1 and rank == 0:
                meta = modules.describe(newest, 1, book.model_factory(), None, {}, values_of(self, book), self.sampler)
            meta = meta_wire.broadcast_meta(meta, 0, rank, facts.round, facts.backend)
        else:
            holders = {}
            for r, pairs in held.items():
                for key, shard in pairs:
                    if key == chosen:
                        holders.setdefault(shard, []).append(r)
            sources = {s.shard: s for s in slots}
        same_shape = not first_start and chosen[1] == hyb.shape.group_size
        # A refill's bytes travel while the meta is broadcast and the model is built.
        refill = post_refill(rank, plan, reports, chosen, holders, sources) if same_shape else None
        if not first_start:
            wanted = (newest.round, newest.count, chosen[1])
            if all(wanted in rep[1] for rep in held_reports):
                # Every rank holds the commit's meta (a loss: only survivors): nothing to send.
                meta = copy.deepcopy(book.metas[chosen])
            else:
                source_rank = min(r for r, rep in enumerate(held_reports) if wanted in rep[1])
                meta = meta_wire.broadcast_meta(book.metas.get(chosen) if rank == source_rank else None, source_rank,
                                                rank, facts.round, facts.backend)
        model = optimizer = scheduler = None
        targets: dict = {}
        meta_done = time.monotonic()
        if trains:
            model = self._build(ring, mesh)
            optimizer = book.optimizer_factory(model) if book.optimizer_factory is not None else None
            scheduler = book.scheduler_factory(optimizer) if book.scheduler_factory is not None else None
            states = modules.empty_optimizer_state(model, meta) if not first_start else {}
            targets = {f"model.{fqn}": p for fqn, p in model.named_parameters()}
            targets.update(states)
        model_built = time.monotonic()
        received_slot = None
        if first_start and (book.init is not None or hyb.shape.tensor_parallel > 1):
            moved = 0
            if trains:
                self._initialise(model)
        elif same_shape:
            moved, received_slot = finish_refill(refill, meta, chosen, sources, targets)
        else:
            if hyb.shape.tensor_parallel > 1:
                raise ElasticError(f"commit {newest.count} was made by a ring of {meta.world}, not by groups of "
                                   f"{hyb.shape.group_size}: a tensor-parallel model is only restored group by group")
            pieces = []
            for members in plan.groups:
                pieces += plan_reshard(meta.layout, meta.world, holders, hyb.shape.shard_size, receivers=members)
            moved = run_pieces(pieces, rank, sources, {k: modules.local(t) for k, t in targets.items()})
        moved_at = time.monotonic()
        states = {k: v for k, v in targets.items() if k.startswith("optim.")}
        if trains:
            if meta is not None:
                self._load_meta(model, optimizer, meta, states, first_start)
                modules.load_scheduler(scheduler, meta.scheduler)
            self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        book.last_reshard_bytes = moved
        del sources
        book.take(newest)
        if trains:
            own = received_slot or next((s for s in slots if same_shape and s.shard == hyb.coordinate), None)
            if own is not None:  # the slot this worker restored from is the commit in this layout already
                own.forget_sources()
                book.own, book.own_older, book.legacy = own, [], []
                if meta is not None:
                    book.metas[(newest, hyb.shape.group_size)] = meta
            else:
                self._snapshot_and_replicate(ring, wait=False)
        book.confirm_ring = False
        book.synced = True
        seconds = time.monotonic() - started
        hyb.last = {"mesh_s": built - started, "agree_s": agreed - built, "meta_s": meta_done - agreed,
                    "build_s": model_built - meta_done, "move_s": moved_at - model_built, "moved": moved,
                    "seconds": seconds, "plan": plan.describe()}
        log.info("round %d: %s commit %d on %s: received %.3f MB in %.3fs", facts.round,
                 "restored" if same_shape else "re-sharded", newest.count, plan.describe(), moved / 1e6, seconds)
        self._report_reshard(ring, "start" if first_start else "memory", newest.count,
                             meta.world if meta is not None else 1, moved, seconds)
        holding = tuple(sorted({r for ranks in holders.values() for r in ranks}))
        result = SyncPlan(newest, holding, tuple(r for r in range(facts.world_size) if r not in holding), ())
        self._after_sync(ring, plan, rank, trains)
        return result

    def _after_sync(self, ring, plan: MeshPlan, rank: int, trains: bool) -> None:
        """The lead ticks the spares; a spare waits (spares.py) and never returns from here."""
        hyb = self._hybrid
        if not plan.spares:
            return
        lead = plan.training[0]
        if rank == lead:
            hyb.ticks = SpareTicks(plan.spares)
        if not trains:
            log.info("round %d: rank %d waits as a spare (its group %s is broken) holding commit %s",
                     ring.round, rank, list(hyb.group or ()), self._book.legacy[0].commit.count
                     if self._book.legacy else None, extra=FILE_ONLY)
            wait_as_spare(ring, lead)

    def _initialise(self, model) -> None:
        """A first start without a commit: ``init=`` on each worker's own shards, or (tensor
        parallel) the whole model built on every training worker and its parts taken."""
        book = self._book
        if book.init is not None:
            book.init(model)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        whole = book.model_factory()
        set_model_state_dict(model, whole.state_dict(), options=StateDictOptions(full_state_dict=True))

    def _resume_from_disk_hybrid(self, ring, facts, plan, mesh, group, found, started) -> Optional[SyncPlan]:
        """The training workers load their shards of a durable checkpoint (any mesh shape
        reads it); spares load nothing, but verify their share of its checksums as every
        rank does (``resume_check.load_verified``). None, on every rank, when they do not match."""
        book = self._book
        path, manifest = found
        self._hold_only([])
        trains = plan.trains(facts.rank)
        model = self._build(ring, mesh) if trains else None
        optimizer = book.optimizer_factory(model) if trains else None
        scheduler = book.scheduler_factory(optimizer) if trains and book.scheduler_factory is not None else None
        verified, saved = resume_check.load_verified(ring, found, (lambda: durable.load_into(path, model, optimizer, group))
                                                if trains else None, book.durable.policy.skip_unreadable)
        if not verified:
            if trains:  # not this one: its memory goes before an older one's model is built
                free_storage(model, optimizer)
            return None
        if trains:
            modules.load_scheduler(scheduler, saved.get("scheduler"))
            for name, value in saved["values"].items():
                setattr(self, name, value)
            if self.sampler is not None and saved.get("sampler") is not None:
                self.sampler.load_state_dict(saved["sampler"])
            self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
            book.count = int(saved["commits"])
            book.round = facts.round
            self._snapshot_and_replicate(ring, wait=True)
        book.synced = True
        seconds = time.monotonic() - started
        log.info("round %d: resumed from durable checkpoint step %s (world %s -> %s) in %.3fs", facts.round,
                 manifest["step"], manifest.get("world_size"), plan.describe(), seconds)
        self._report_reshard(ring, "disk", book.count, manifest.get("world_size"), 0, seconds)
        self._after_sync(ring, plan, facts.rank, plan.trains(facts.rank))
        return SyncPlan(self.commit_id, (), tuple(range(facts.world_size)), ())

    # -- the rest of the protocol ---------------------------------------------------------
    def on_reset(self, ring: RingView) -> None:
        share = self._share(ring)
        if self.sampler is not None and hasattr(self.sampler, "set_rank") and share is not None:
            self.sampler.set_rank(*share)
        self._book.run_reset_callbacks()

    def flush_checkpoints(self, ring: RingView, final: bool = False) -> None:
        hyb = self._hybrid
        if hyb.hybrid and not hyb.plan.trains(ring.rank):
            return  # a spare writes nothing
        super().flush_checkpoints(ring, final)
        if final and hyb.ticks is not None and not hyb.stopping:
            hyb.ticks.end(self._book.count)  # after the last write: the spares finish
            hyb.ticks = None

