"""Getting into the next round: its plan, its store, the arrival of every worker, its process group.

A worker follows the job's control channel (plan + status) in etcd. For each round it
builds a fresh process group on a fresh namespace of the round's store (the TCPStore
that rank 0's agent serves: ``contract/round_keys.py``). ``RingEntry`` does that, in
three steps the recovery loop calls in order:

    next_plan  a failed worker asks for a round (``reset_nudge.py``), then waits for a
               plan after the one it leaves that includes it (--rdzv-timeout)
    arrive     connect to the round's store and wait there for every worker of the
               round; a newer plan that includes us meanwhile is followed instead
    form       init the process group: the ``Ring`` (``ring.py``), this worker's
               position in it, torchrun's variables; after a loss on NCCL, on the
               communicator the old ring's abort shrank, where every worker holds
               one (``ring_shrink.py``)

It also holds the one thing the main thread and the control thread share, ``RingCell``:
the forming or formed ring, which the control thread aborts when a newer plan declares
it broken (gloo wakes only the dead worker's neighbours at once; the others would sit in
their collective until the timeout).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from elastic.rendezvous import ControlChannel, Etcd, JobStatus, RoundPlan
from elastic.rendezvous.errors import RendezvousTimeoutError

from ..contract import round_keys
from ..contract.agent_channel import RingBroke, tell_agent
from ..contract.console import FILE_ONLY
from ..contract.devices import Capability
from ..contract.errors import ElasticError, LeftJob, PeersUnreachable
from ..contract.events import EventLog
from ..contract.faults import NETWORK
from ..contract.worker_config import WorkerConfig
from . import device_watch, fault_points, nccl_abort, ring_shrink, round_store
from .commit_gate import Monitors
from .failures import classify_init
from .reset_nudge import ResetNudge
from .ring import Ring
from .ring_abort import (RingHandle, SocketSnapshot, forget_failed_init, forming_ring, leave_ring, peer_lost,
                         prepare_ring, ring_breaks, socket_snapshot)
from .ring_view import Position

log = logging.getLogger(__name__)


def abort_reason(newer: Optional[RoundPlan], status: JobStatus, current: RoundPlan) -> Optional[str]:
    """Why ``current``'s ring must be aborted now that the job's control says ``newer`` and
    ``status``, or None: the job failed, or a newer round lost one of its workers or recovers
    from a failure (a reset request names no one lost; on NCCL nothing else wakes the others'
    kernels)."""
    if status.state == "failed":
        return f"job failed: {status.reason}"
    if ring_breaks(newer, current):
        return f"round {newer.round} lost {len(newer.lost)} worker(s)" if newer.lost else \
            f"round {newer.round} recovers from a failure (a reset request)"
    return None


@dataclass(frozen=True)
class Forming:
    """A round whose process group is being initialised: its plan and the handle that
    aborts the init (the connections made since its socket snapshot)."""

    plan: RoundPlan
    handle: RingHandle
    capability: Optional[Capability] = None  # a ring's; none while its group forms: nothing to shrink


class RingCell:
    """The forming or formed ring: the one thing the control thread and the main thread share.

    The main thread puts each ring here as it forms (``hold_forming``, then ``hold_formed``),
    the control thread aborts what it holds when a newer plan breaks it (``on_control``). A
    ring that was left, or an init that failed, stays until the next one replaces it: its
    handle is forgotten by then, so an abort of it does nothing."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: Optional[Union[Forming, Ring]] = None
        self._formed: Optional[Ring] = None
        self.shrunk = ring_shrink.ShrunkForNextRound()  # what an abort shrank, for the next round's form

    def hold_forming(self, forming: Forming, newest: Optional[RoundPlan], status: JobStatus) -> None:
        """Make ``forming`` the one the control thread aborts; a break the control channel has
        announced already (``newest``, ``status``) aborts it now."""
        with self._lock:
            self._held = forming
        self._abort_if_broken(forming, newest, status)

    def hold_formed(self, ring: Ring, newest: Optional[RoundPlan], status: JobStatus) -> None:
        """As ``hold_forming``, for the ring the init formed: from now on the worker's ring."""
        with self._lock:
            self._held = self._formed = ring
        self._abort_if_broken(ring, newest, status)

    def on_control(self, plan: Optional[RoundPlan], status: JobStatus) -> None:
        """The control thread's listener: abort the held ring if ``plan`` breaks it."""
        with self._lock:
            ring = self._held
        if ring is not None:
            self._abort_if_broken(ring, plan, status)

    def _abort_if_broken(self, ring, newest, status) -> None:
        why = abort_reason(newest, status, ring.plan)
        if why is None:
            return
        excluded = self._shrinkable(ring, newest, status)
        if excluded is None:
            log.info("round %d: aborting the ring (%s)", ring.plan.round, why, extra=FILE_ONLY)
            ring.handle.abort()
            return
        # The plan that breaks the ring names its successor: the abort's NCCL part shrinks
        # the communicator to it first (ring_shrink.py: why here, and not at the form).
        log.info("round %d: aborting the ring (%s); its NCCL communicator shrinks to round %d's workers "
                 "(ranks %s left out)", ring.plan.round, why, newest.round, list(excluded), extra=FILE_ONLY)
        ring.handle.abort(backend_abort=lambda backend: ring_shrink.shrink_then_abort(
            backend, excluded, lambda shrunk: self.shrunk.put(newest, shrunk)))

    @staticmethod
    def _shrinkable(ring, newest, status):
        """The ranks to leave out of ``ring``'s NCCL communicator for ``newest``, or None
        (ring_shrink.ranks_to_exclude). A ring still forming has no communicator yet."""
        capability = ring.capability
        if capability is None or not capability.nccl or newest is None or status.state == "failed":
            return None
        handle = ring.handle
        held = handle.backend_abort and not handle.aborted and handle.error() is None
        return ring_shrink.ranks_to_exclude(ring.plan, newest, capability, ring_shrink.support_here(),
                                            communicator_held=held)

    @property
    def held(self) -> Optional[Union[Forming, Ring]]:
        """What the control thread would abort now."""
        return self._held

    @property
    def formed(self) -> Optional[Ring]:
        """The newest ring that formed (while the next one forms, still the old one)."""
        return self._formed


@dataclass(frozen=True)
class Arrival:
    """A round every worker has arrived at: its store, and this worker's sockets before it."""

    plan: RoundPlan
    store: object  # the round's PrefixStore
    before: SocketSnapshot  # this process's sockets before it connected to the store
    store_s: float  # seconds connecting to the store
    arrive_s: float  # seconds waiting there for every worker


class RingEntry:
    """The way into each round (module docstring), and the control thread's cell."""

    def __init__(self, config: WorkerConfig, control: ControlChannel, etcd: Etcd, events: EventLog,
                 monitors: Monitors, capability: Capability, local_rank: int):
        self._config = config
        self._control = control
        self._etcd = etcd
        self._events = events
        self._monitors = monitors
        self._capability = capability
        self._local_rank = local_rank
        self.cell = RingCell()
        self.position: Optional[Position] = None  # where the newest plan puts us (a joiner: before its ring)

    # -- the rings -------------------------------------------------------------------
    @property
    def ring(self) -> Ring:
        """The ring this worker trains on (the newest that formed)."""
        ring = self.cell.formed
        if ring is None:
            raise ElasticError("this worker is in no ring yet: a worker joining a job under way enters its "
                               "round at its first sync, in @elastic.run")
        return ring

    @property
    def round(self) -> int:
        """The round of the newest ring that formed; 0 before the first."""
        ring = self.cell.formed
        return ring.round if ring is not None else 0

    @property
    def joining_round(self) -> Optional[int]:
        """The round a joiner enters at its first sync; None once it tried to enter one."""
        if self.cell.held is not None or self.position is None:
            return None
        return self.position.plan.round

    def start(self) -> None:
        """At ``elastic.init()``: this worker's first plan and position. The job's first
        round is entered at once; a joiner's only at its first sync (``first``): the running
        ring switches to its round once it has arrived, so it arrives when ready to sync,
        not before the script's own set-up (data, model) has run."""
        plan = self._wait_for_plan(lambda p: p.round >= self._config.round)
        self._take_position(plan)
        if plan.round <= 1:
            self.enter(plan, previous_plan=None)

    @property
    def formed(self) -> Optional[Ring]:
        """The newest ring that formed, or None (a joiner before its first sync)."""
        return self.cell.formed

    def joining_plan(self) -> RoundPlan:
        """A joiner's round at its first sync: the one ``start`` gave it a position in, or a
        newer one that includes it."""
        plan = self.position.plan
        newest = self._control.plan
        if newest is not None and newest.round > plan.round and newest.rank_of(self._config.worker_id) is not None:
            plan = newest
        return plan

    def enter(self, plan: RoundPlan, previous_plan: Optional[RoundPlan]) -> Ring:
        """``arrive`` and ``form`` in one call (the job's first round, at ``start``)."""
        return self.form(self.arrive(plan), previous_plan)

    def leave_unformed(self, round_number: int) -> None:
        """After an entry that failed: a process group it left half-made is torn down, or
        the next init would fail as a user error ("default process group twice")."""
        leave_ring(None, failed=True, round_number=round_number)

    def leave_held(self) -> None:
        """At the worker's end: leave whatever ring is held, if any (a no-op for one left already)."""
        ring = self.cell.formed
        if ring is not None:
            ring.leave(failed=False)  # a no-op for its handle if it was left already
        else:
            leave_ring(None, failed=False, round_number=0)

    # -- 1. the next plan ---------------------------------------------------------------
    def next_plan(self, after_round: int, reason: str, *, failed: bool) -> RoundPlan:
        """A plan after round ``after_round`` that includes this worker. A failed worker asks
        for one at once, and again if etcd refused, while it waits; a planned switch waits.
        [graceful-leave] A planned switch to a round without us: our host withdrew us
        (SIGTERM to its agent); leave with LeftJob (exit 0) instead of waiting for a round."""
        nudge = None
        if failed:
            self._events.emit("failure_detected", reason=reason, console=False)  # reform_done says it
            tell_agent(self._config, RingBroke(after_round, reason))  # the agent checks the coordinator
            nudge = ResetNudge(self._control, self._config, after_round, reason).start()
        try:
            return self._wait_for_plan(lambda p: p.round > after_round, leave_if_withdrawn=not failed)
        finally:
            if nudge is not None:
                nudge.stop()

    def _wait_for_plan(self, accept, *, leave_if_withdrawn: bool = False) -> RoundPlan:
        """Wait (bounded by --rdzv-timeout) for a plan that ``accept``s and includes us."""
        cfg = self._config
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

    # -- 2. the arrival -----------------------------------------------------------------
    def arrive(self, plan: RoundPlan) -> Arrival:
        """Arrive at ``plan``'s store with every worker of it; if a newer plan supersedes it
        meanwhile, at that one's."""
        cfg = self._config
        while True:
            started = time.monotonic()
            # Sockets that appear from here on are this round's: the store client and
            # gloo's full mesh. An abort shuts them all down, the store's too: when the
            # store's host is cut off (no RST ever comes), a commit's look at the store
            # would otherwise block for the store timeout.
            before = socket_snapshot()
            if self._capability.nccl:
                nccl_abort.nonblocking_env()  # read when the communicator is made
            base = self._connect_store(plan)
            connected = time.monotonic()
            if base is not None:
                round_store.clear_dump_signal(base, plan.round)  # before our group can read it
                store = dist.PrefixStore(round_keys.prefix(plan.round), base)
                if round_store.arrive(store, plan, timeout_s=cfg.rdzv_timeout,
                                      superseded=lambda p=plan: self._superseded(p)):
                    return Arrival(plan, store, before, connected - started, time.monotonic() - connected)
            plan = self._wait_for_plan(lambda p, r=plan.round: p.round > r)

    def _connect_store(self, plan: RoundPlan):
        """The round's store, or None once a newer plan that includes us exists."""
        cfg = self._config
        return round_store.connect(
            plan.store_addr, round_number=plan.round, overall_s=cfg.rdzv_timeout,
            # gloo's init reads its peers' addresses from here: a peer that died after
            # arriving must fail the init within the collective timeout, not --rdzv-timeout.
            op_timeout_s=min(cfg.rdzv_timeout, cfg.collective_timeout), superseded=lambda: self._superseded(plan),
        )

    def _superseded(self, plan: RoundPlan) -> bool:
        newest = self._control.plan
        if newest is not None and newest.round > plan.round and newest.rank_of(self._config.worker_id) is not None:
            log.info("round %d superseded by round %d before it formed", plan.round, newest.round)
            return True
        if self._control.status.over:
            raise LeftJob(f"job {self._control.status.state}")
        return False

    # -- 3. the process group -------------------------------------------------------------
    def form(self, arrival: Arrival, previous_plan: Optional[RoundPlan]) -> Ring:
        """Init the process group of the round every worker arrived at: the ``Ring``."""
        cfg, plan, capability = self._config, arrival.plan, self._capability
        rank = plan.rank_of(cfg.worker_id)
        fault_points.entering_round(plan.round, rank)  # a no-op unless a test installed a fault there
        # A peer that dies now leaves the others waiting in the init for its address
        # until the store's timeout: the round that names it lost aborts the init.
        # On pure NCCL the store's connections alone: the sockets NCCL makes are its own.
        store_port = int(plan.store_addr.rsplit(":", 1)[1])
        forming = Forming(plan, forming_ring(arrival.before, port=None if capability.gloo else store_port))
        self.cell.hold_forming(forming, self._control.plan, self._control.status)
        excepthook = sys.excepthook  # torch wraps it at every init: [rankN] prefixes, stale ranks
        try:
            self._init_group(arrival, rank, previous_plan)
        except Exception as exc:
            forming.handle.forget()  # the failed init's sockets are no ring's: never shut them later
            forget_failed_init()
            fault = classify_init(exc, peer_lost=peer_lost(self._control.plan, plan))
            if fault.kind != NETWORK:
                raise  # a peer died (one more failure of the ring), or not the ring's fault at all
            # Everyone reached the store, but not each other: name the addresses.
            addresses = sorted({addr for _, addr in plan.hosts.values()})
            raise PeersUnreachable(plan.round, addresses, fault.reason) from None
        finally:
            sys.excepthook = excepthook  # the agent prefixes every line with the rank itself
        handle = prepare_ring(before=arrival.before, store_port=store_port)
        device_watch.watch_ring(handle)  # on NCCL's error the device watch aborts it, as gloo's timeout ends a wait
        if forming.handle.aborted:
            # A loss announced during the init aborted only the forming handle (its
            # sockets); no later plan repeats the news, and NCCL's rings over IB never
            # noticed: the formed ring is broken too.
            handle.abort()
        ring = Ring(plan=plan, previous_plan=previous_plan, position=self._take_position(plan),
                    capability=capability, handle=handle, monitors=self._monitors,
                    config=cfg, events=self._events, etcd=self._etcd)
        # A loss delivered between the check above and now aborted the forming handle
        # too late for it: the control channel holds that plan already, so holding the
        # formed ring checks it again.
        self.cell.hold_formed(ring, self._control.plan, self._control.status)
        return ring

    def _init_group(self, arrival: Arrival, rank: int, previous_plan: Optional[RoundPlan]) -> None:
        """The round's process group: ``init_process_group``, or, for a round that only lost
        workers of the previous one, a group on the NCCL communicator that the previous
        ring's abort shrank for it, when every worker of the round holds one (ring_shrink.py)."""
        cfg, plan, capability = self._config, arrival.plan, self._capability
        timeout = datetime.timedelta(seconds=cfg.collective_timeout)

        def init_fresh(group_store) -> None:
            dist.init_process_group(
                cfg.backend, store=group_store, rank=rank, world_size=plan.world_size, timeout=timeout,
                # NCCL: communicators made now (eager), inside the forming ring's abort
                # and PeersUnreachable, not at the first collective (docs/gpus.md).
                **({"device_id": nccl_abort.device_of_this_worker()} if capability.nccl else {}),
            )

        if not capability.nccl:  # gloo alone: no communicator to shrink
            init_fresh(dist.PrefixStore(round_keys.GROUP, arrival.store))
            return
        shrunk = self.cell.shrunk.take(plan)
        # Whether the round may form on shrunk communicators is the same answer on every
        # worker of it (its plan, the previous one, the job's backend and software); whether
        # each one holds one is theirs to say: init_group settles it among them.
        excluded = ring_shrink.ranks_to_exclude(previous_plan, plan, capability, ring_shrink.support_here(),
                                                communicator_held=True)
        if excluded is None:
            ring_shrink.drop(shrunk)
            init_fresh(dist.PrefixStore(round_keys.GROUP, arrival.store))
            return
        ring_shrink.init_group(shrunk, init_fresh, store=arrival.store, rank=rank, world_size=plan.world_size,
                               timeout=timeout, device=nccl_abort.device_of_this_worker(), backend=cfg.backend,
                               round_number=plan.round)

    def _take_position(self, plan: RoundPlan) -> Position:
        """Our rank and world in ``plan`` (torchrun's variables too). The local rank is
        the device slot the session pinned: a plan never moves a worker to another GPU."""
        cfg = self._config
        position = Position.in_plan(plan, cfg.worker_id, self._local_rank)
        if self._capability.nccl and torch.cuda.current_device() != self._local_rank:
            # Its model and optimizer are on its slot's GPU: going on elsewhere would
            # share a GPU with a peer and drive two. A bug, never a fault to re-form for.
            raise ElasticError(f"worker {cfg.worker_id} would move from cuda:{self._local_rank} to "
                               f"cuda:{torch.cuda.current_device()} in round {plan.round}")
        self.position = position
        self._events.rank, self._events.round = position.rank, plan.round
        # Keep torchrun's variables true for user code that reads them.
        os.environ.update(
            RANK=str(position.rank),
            WORLD_SIZE=str(plan.world_size),
            LOCAL_RANK=str(self._local_rank),
            LOCAL_WORLD_SIZE=str(position.local_world_size),
            GROUP_RANK=str(plan.member_order().index(plan.slots[position.rank].member_id)),
        )
        return position
