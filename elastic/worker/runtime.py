"""The worker's side of the rounds: which ring am I in, and how to move on.

A worker follows the job's control channel (plan + status) in etcd. For each
round it builds a fresh process group on a fresh store namespace
(``/round/<n>/`` of the TCPStore that rank 0's agent serves); re-using a
namespace hangs. Moving to the next round happens in one of two ways:

* the ring broke (a collective raised): ``reform(failed=True)`` drops the old
  group, asks the coordinator for a new round, waits for it and joins it;
* a newer plan exists while the ring still works (a host joined or is leaving):
  rank 0 posts, in the round's store, the commit at which everybody switches;
  every worker reads that key at its commits and raises
  ``HostsUpdatedInterrupt`` at the same commit, so nothing is rolled back.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from elastic.rendezvous import ControlChannel, Etcd, EtcdConfig, JobKeys, RoundPlan
from elastic.rendezvous.errors import RendezvousTimeoutError
from elastic.rendezvous.job_secret import read_private_file
from elastic.rendezvous.member_sync import follow_members

from .left_behind import LeftBehindCheck
from .commit_gate import CommitGate, Ticket, Verdict
from ..contract.console import FILE_ONLY
from ..contract.devices import uses_nccl
from . import publish_check
from .reset_nudge import ResetNudge
from ..contract.errors import ElasticError, LeftJob, PeersUnreachable
from ..contract.faults import NETWORK
from .failures import classify_init
from . import device_commit, fault_points, nccl_abort, round_store
from ..contract.events import EventLog
from ..contract.progress import Progress
from .step_log import StepLog
from .ring_abort import (RingHandle, broken_reason, check_ring, forget_failed_init, forming_ring, leave_ring,
                         peer_lost, prepare_ring, ring_breaks, socket_snapshot)
from .stragglers import StragglerWatch
from ..contract.worker_config import WorkerConfig

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ReformTimes:
    drop_s: float  # destroy the old group, free its sockets
    rendezvous_s: float  # wait for the next plan
    pg_init_s: float  # arrival barrier + process group, of which:
    store_s: float = 0.0  # connecting to the round's store
    arrive_s: float = 0.0  # waiting there for every worker of the round
    group_s: float = 0.0  # init_process_group (gloo: publish and read addresses, connect the mesh)


class Runtime:
    def __init__(self, config: Optional[WorkerConfig]):
        self.config = config
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self.local_world_size = 1
        self.round = 0
        self.plan: Optional[RoundPlan] = None
        self.previous_plan: Optional[RoundPlan] = None  # the ring before: bounds its commits (sync_plan.ClaimBounds)
        self.events = EventLog(
            config.events_file if config else None, host=config.host_id if config else "local"
        )
        self._etcd: Optional[Etcd] = None
        self._control: Optional[ControlChannel] = None
        self._deferred: Optional[RoundPlan] = None  # a joiner's round, entered at its first sync
        self._ring: Optional[RingHandle] = None  # the current round's ring, for abort()
        self._forming: Optional[tuple] = None  # (plan, RingHandle) of a round whose init is under way
        self._tried_round = 0  # the newest round whose init we began (it may have failed)
        self._backend_lock = threading.Lock()
        self.steps = StepLog(self.events, config.worker_id if config else "local")  # for the timeline
        self.gate = CommitGate(self.steps, self.check_ring_before_commit)  # a commit's one call

    @property
    def max_resets(self) -> int:
        return self.config.max_resets if self.config else 0

    @property
    def reset_window(self) -> float:
        return self.config.reset_window if self.config else 3600.0

    @property
    def elastic(self) -> bool:
        return self.config is not None

    @property
    def backend(self) -> str:
        return self.config.backend if self.config else "gloo"

    # -- start ----------------------------------------------------------------
    def start(self) -> None:
        if self.config is None:
            # Not under elastic-run: a world of one, so scripts stay runnable alone.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            return
        cfg = self.config
        gate = self.gate
        if cfg.progress_file:
            gate.progress = Progress(cfg.progress_file, cfg.stacks_file)
        # Its exchanges give every rank the same pace: switch points are spaced by it.
        gate.stragglers = StragglerWatch(self, cfg.straggler_ratio, on_pace=lambda *pace: gate.points.agree(*pace))
        if cfg.marker_file:
            # Tells the agent this worker follows rounds itself (no restart on change).
            with open(cfg.marker_file, "w") as f:
                f.write(str(os.getpid()))
        self._etcd = follow_members(Etcd(  # a served etcd's members move (rendezvous/served.py)
            EtcdConfig.from_string(
                cfg.endpoints,
                ca_cert=cfg.etcd_ca,
                cert_cert=cfg.etcd_cert,
                cert_key=cfg.etcd_key,
                user=cfg.etcd_user,
                password=read_private_file(cfg.etcd_password_file, "etcd password file")
                if cfg.etcd_password_file else None,
                retry_deadline=cfg.etcd_retry_deadline,
                member_sync=cfg.etcd_member_sync,
            )
        ))
        self._control = ControlChannel(self._etcd, JobKeys(cfg.job_id)).start()
        gate.control = self._control
        gate.left_behind = LeftBehindCheck(self._etcd, JobKeys(cfg.job_id), cfg.worker_id, cfg.rdzv_ttl)
        self._control.add_listener(self._on_control)
        # The device slot its agent gave this process (device_slots.py): LOCAL_RANK and the
        # CUDA device for its whole life, set once, before any process group exists.
        self.local_rank = cfg.device_slot if cfg.device_slot is not None else 0
        if uses_nccl(cfg.backend):
            torch.cuda.set_device(self.local_rank)
        plan = self._wait_for_plan(lambda p: p.round >= cfg.round)
        self._take_position(plan)
        if plan.round > 1:
            # Joining a job under way: the running ring switches to this round only
            # once we have arrived, so arrive when ready to sync (in @elastic.run),
            # not now, before the script's own set-up (data, model) has run.
            self._deferred = plan
        else:
            self._enter(plan)

    @property
    def position_plan(self) -> Optional[RoundPlan]:
        """The round this worker has its rank in: a joiner's, entered only at its first
        sync, is known from the start (``hvd.rank()`` before the first sync)."""
        return self.plan or self._deferred

    @property
    def joining_round(self) -> Optional[int]:
        """The round a joiner enters at its first sync; None once it is in a ring."""
        return self._deferred.round if self._deferred is not None else None

    def ensure_joined(self) -> None:
        """Join the ring whose position ``start`` took, if that was deferred."""
        if self._deferred is None:
            return
        plan, self._deferred = self._deferred, None
        newest = self._control.plan
        if newest is not None and newest.round > plan.round and newest.rank_of(self.config.worker_id) is not None:
            plan = newest
        self._enter(plan)

    # -- a commit (commit_gate.py) -----------------------------------------------
    def commit(self, capture) -> Verdict:
        """A state's commit, the one call it makes: left behind?, ring check, ``capture(ticket)``,
        step log, pace exchange and the switch decision, in that order (commit_gate.py)."""
        ticket = Ticket(self.round, self.rank, self.world_size, self.publish_check)
        verdict = self.gate.at_commit(capture, ticket, self.plan)
        if verdict is not Verdict.CONTINUE:
            device_commit.before_planned_leave(self)  # overlapped commits: the step's kernels end first
        return verdict

    def begin_round(self) -> None:
        """The training function is (re-)entered on the current ring."""
        self.gate.begin()

    def end_training(self) -> None:
        """The training function returned for good."""
        self.steps.close()
        if self.gate.progress is not None:
            self.gate.progress.board.left_training()

    @property
    def progress_board(self):
        """The worker's progress board (contract/progress.py), None outside elastic-run."""
        return self.gate.progress.board if self.gate.progress is not None else None

    def check_ring_before_commit(self) -> None:
        """Before ``commit()`` overwrites the snapshot: raise ``RingBroken`` (a ring failure;
        the previous commit stays the rollback target) unless the step's collectives
        completed without error. On NCCL that takes a sync of the current stream: its
        collectives do not block the host, and an abort lets the queued optimizer step
        apply partial gradients. gloo's raise at once: no sync there."""
        with self._backend_lock:
            ring = self._ring
        check_ring(ring, device_sync=device_commit.drains_at_commit(self.backend))  # (G13: opt-in overlap)

    def ring_broken(self) -> Optional[str]:
        """Why the current ring is broken (aborted, its backend's error), or None (gpu review G12)."""
        return broken_reason(self._ring)  # one read of the attribute: no lock needed

    def ring_change_ready(self) -> bool:
        """Rank 0's view, asked between commits (``hvd.elastic``'s ``check_host_updates``)."""
        return self.gate.ring_change_ready(self.plan, self.round)

    # -- moving to the next round ----------------------------------------------
    def reform(self, reason: str, *, failed: bool) -> ReformTimes:
        """Leave the current ring and join the next round's. Call outside any
        ``except`` block: a live traceback keeps the old group's sockets open."""
        t0 = time.monotonic()
        self.steps.close()  # the old ring's last steps end here: the gap starts
        # After a failed init, that round is the one to leave behind: re-entering it
        # would re-use its store namespace, which hangs.
        old_round = max(self.round, self._tried_round)
        # A planned switch leaves together: nobody is blocked, no garbage to chase.
        self.drop_ring(failed=failed)
        t1 = time.monotonic()
        nudge = None
        if failed:
            self.events.emit("failure_detected", reason=reason, console=False)  # reform_done says it
            # Asks for a round at once, and again if etcd refused, while we wait.
            nudge = ResetNudge(self._control, self._etcd, self.config, old_round, reason).start()
        try:
            # [graceful-leave] A planned switch to a round without us: our host withdrew
            # us (SIGTERM to its agent); leave with exit 0 instead of waiting for a round.
            plan = self._wait_for_plan(lambda p: p.round > old_round, leave_if_withdrawn=not failed)
        finally:
            if nudge is not None:
                nudge.stop()
        t2 = time.monotonic()
        entry = self._enter(plan)
        t3 = time.monotonic()
        return ReformTimes(t1 - t0, t2 - t1, t3 - t2, *entry)

    def _on_control(self, plan, status) -> None:
        """Control-watch thread: abort a ring that a newer plan declares broken.

        gloo wakes only the dead worker's neighbours at once; the others would sit
        in their collective until the timeout (gloo's own abort() does not wake
        them: see ring_abort.py). Aborting fails their pending operations now,
        and the recovery path takes over.
        """
        with self._backend_lock:
            # The ring in use, or the one whose init is under way (waiting for its peers).
            current, ring = self._forming or (self.plan, self._ring)
            if current is None or ring is None:
                return
            if status.state == "failed":
                why = f"job failed: {status.reason}"
            elif ring_breaks(plan, current):
                why = f"round {plan.round} lost {len(plan.lost)} worker(s)" if plan.lost else \
                    f"round {plan.round} recovers from a failure (a reset request)"
            else:
                return
            log.info("round %d: aborting the ring (%s)", current.round, why, extra=FILE_ONLY)
            ring.abort()

    def abort_device_ring(self) -> None:
        """After a failure, before the device check: abort the ring's NCCL part (a no-op if
        the control thread did), so that none of its kernels is left for the check to
        wait on (gpu review G1). The ring is dropped later, by ``reform``."""
        with self._backend_lock:
            ring = self._ring
        if ring is not None and ring.backend_abort:
            ring.abort()
            ring.wait_aborted()  # bounded: past its deadline the worker exits broken

    def adopt_connections(self, before) -> None:
        """Process groups made on the current ring since ``before`` (a ``socket_snapshot``):
        an abort of the ring shuts their connections too (ring_abort.RingHandle.include_since)."""
        with self._backend_lock:
            ring = self._ring
        if ring is not None:
            ring.include_since(before)

    def abort_ring(self) -> None:
        """Fail the peers' pending operations at once (a fault only this worker saw)."""
        with self._backend_lock:
            ring = self._ring
        if ring is not None:
            ring.abort()

    def drop_ring(self, failed: bool = False) -> None:
        """Leave the current ring. An NCCL ring is aborted, never destroyed, at a planned
        switch too: ``destroy_process_group`` finalizes its communicators, which waits for
        pending work and can block on a dead peer (gpu review F5, G8; ring_abort.leave_ring)."""
        with self._backend_lock:
            ring, self._ring = self._ring, None
        self.gate.leave()
        leave_ring(ring, failed=failed, round_number=self.round)

    def _wait_for_plan(self, accept, *, leave_if_withdrawn: bool = False) -> RoundPlan:
        """Wait (bounded by --rdzv-timeout) for a plan that ``accept``s and includes us."""
        cfg = self.config
        worker = cfg.worker_id
        deadline = time.monotonic() + cfg.rdzv_timeout
        ready = lambda p, s: s.over or (  # noqa: E731
            p is not None and accept(p) and (leave_if_withdrawn or p.rank_of(worker) is not None)
        )
        ok = self._control.wait_for(ready, max(0.0, deadline - time.monotonic()))
        status = self._control.status
        if status.over:
            raise LeftJob(f"job {status.state}: {status.reason}")
        if not ok:
            raise RendezvousTimeoutError(
                f"worker {worker}: no round including it within {cfg.rdzv_timeout:g}s"
            )
        plan = self._control.plan
        if plan.rank_of(worker) is None:  # [graceful-leave] only with leave_if_withdrawn
            raise LeftJob(f"withdrawn from round {plan.round} (graceful leave)")
        return plan

    def _enter(self, plan: RoundPlan) -> tuple[float, float, float]:
        """Join ``plan``'s ring; if a newer plan supersedes it meanwhile, join that.
        Returns the seconds spent connecting to its store, arriving, and in the init."""
        cfg = self.config
        while True:
            started = time.monotonic()
            rank = plan.rank_of(cfg.worker_id)
            # Sockets that appear from here on are this round's: the store client and
            # gloo's full mesh. An abort shuts them all down, the store's too: when the
            # store's host is cut off (no RST ever comes), a commit's look at the store
            # would otherwise block for the store timeout.
            before = socket_snapshot()
            nccl = uses_nccl(cfg.backend)
            if nccl:
                nccl_abort.nonblocking_env()  # read when the communicator is made
            base = self._connect_store(plan)
            connected = time.monotonic()
            if base is not None:
                round_store.clear_dump_signal(base, plan.round)  # before our group can read it (gpu review G2)
                store = dist.PrefixStore(f"/round/{plan.round}/", base)
                if round_store.arrive(store, plan, timeout_s=cfg.rdzv_timeout,
                                      superseded=lambda p=plan: self._superseded(p)):
                    break
            plan = self._wait_for_plan(lambda p, r=plan.round: p.round > r)
        arrived = time.monotonic()
        fault_points.entering_round(plan.round, rank)  # a no-op unless a test installed a fault there
        # A peer that dies now leaves the others waiting in the init for its address
        # until the store's timeout: the round that names it lost aborts the init.
        self._tried_round = plan.round
        # On pure NCCL the store's connections alone: the sockets NCCL makes are its own.
        store_port = int(plan.store_addr.rsplit(":", 1)[1])
        with self._backend_lock:
            self._forming = (plan, forming_ring(before, port=store_port if "gloo" not in cfg.backend else None))
        self._on_control(self._control.plan, self._control.status)  # a loss announced already
        excepthook = sys.excepthook  # torch wraps it at every init: [rankN] prefixes, stale ranks
        try:
            dist.init_process_group(
                cfg.backend,
                store=dist.PrefixStore("pg/", store),
                rank=rank,
                world_size=plan.world_size,
                timeout=datetime.timedelta(seconds=cfg.collective_timeout),
                # NCCL: communicators made now (eager), inside the forming ring's abort
                # and PeersUnreachable, not at the first collective (gpu review F4a).
                **({"device_id": nccl_abort.device_of_this_worker()} if nccl else {}),
            )
        except Exception as exc:
            with self._backend_lock:
                self._forming = None
            forget_failed_init()
            fault = classify_init(exc, peer_lost=peer_lost(self._control.plan, plan))
            if fault.kind != NETWORK:
                raise  # a peer died (one more failure of the ring), or not the ring's fault at all
            # Everyone reached the store, but not each other: name the addresses.
            addresses = sorted({addr for _, addr in plan.hosts.values()})
            raise PeersUnreachable(plan.round, addresses, fault.reason) from None
        finally:
            sys.excepthook = excepthook  # the agent prefixes every line with the rank itself
        initialized = time.monotonic()
        with self._backend_lock:
            forming, self._forming = self._forming, None
            self._ring = prepare_ring(before=before, store_port=store_port)
            if forming is not None and forming[1].aborted:
                # A loss announced during the init aborted only the forming handle (its
                # sockets); no later plan repeats the news, and NCCL's rings over IB never
                # noticed: the formed ring is broken too (gpu review G5(a)).
                self._ring.abort()
            self.previous_plan, self.plan = self.plan, plan
            self.round = plan.round
        self.gate.enter(store)
        self._take_position(plan)
        return connected - started, arrived - connected, initialized - arrived

    def _connect_store(self, plan: RoundPlan):
        """The round's store, or None once a newer plan that includes us exists."""
        cfg = self.config
        return round_store.connect(
            plan.store_addr, round_number=plan.round, overall_s=cfg.rdzv_timeout,
            # gloo's init reads its peers' addresses from here: a peer that died after
            # arriving must fail the init within the collective timeout, not --rdzv-timeout.
            op_timeout_s=min(cfg.rdzv_timeout, cfg.collective_timeout), superseded=lambda: self._superseded(plan),
        )

    def _superseded(self, plan: RoundPlan) -> bool:
        newest = self._control.plan
        if newest is not None and newest.round > plan.round and newest.rank_of(self.config.worker_id) is not None:
            log.info("round %d superseded by round %d before it formed", plan.round, newest.round)
            return True
        if self._control.status.over:
            raise LeftJob(f"job {self._control.status.state}")
        return False

    def _take_position(self, plan: RoundPlan) -> None:
        """Our rank and world in ``plan`` (torchrun's variables too). The local rank is
        the device slot ``start`` pinned: a plan never moves a worker to another GPU."""
        cfg = self.config
        rank = plan.rank_of(cfg.worker_id)
        self.rank = rank
        self.world_size = plan.world_size
        mine = plan.local_ranks(plan.slots[rank].member_id)
        self.local_world_size = len(mine)
        if uses_nccl(cfg.backend) and torch.cuda.current_device() != self.local_rank:
            # Its model and optimizer are on its slot's GPU: going on elsewhere would
            # share a GPU with a peer and drive two. A bug, never a fault to re-form for.
            raise ElasticError(f"worker {cfg.worker_id} would move from cuda:{self.local_rank} to "
                               f"cuda:{torch.cuda.current_device()} in round {plan.round}")
        self.events.rank, self.events.round = rank, plan.round
        # Keep torchrun's variables true for user code that reads them.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(plan.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            GROUP_RANK=str(plan.member_order().index(plan.slots[rank].member_id)),
        )

    # -- fencing durable writes ---------------------------------------------------
    def publish_check(self):
        """A check for the checkpoint writer, asked right before it publishes a write
        of the current round: has this worker been in every round since (read afresh
        from etcd)? A host cut off and healed must never publish what it wrote before
        the job moved on without it (elastic/worker/publish_check.py says why being in the
        newest plan is not enough)."""
        if self.config is None:
            return None
        return publish_check.make(self._etcd, JobKeys(self.config.job_id), self.config.worker_id, self.round)

    # -- end --------------------------------------------------------------------
    def shutdown(self) -> None:
        self.steps.close()
        self.drop_ring()
        if self._control is not None:
            self._control.close()
        gate = self.gate
        if gate.left_behind is not None:
            gate.left_behind.close()
        if self._etcd is not None:
            self._etcd.close()
        gate.close()
        if gate.progress is not None:
            gate.progress.close()
            gate.progress = None
        if gate.stragglers is not None:
            gate.stragglers.close()
            gate.stragglers = None

