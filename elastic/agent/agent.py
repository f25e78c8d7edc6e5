"""The per-host agent: registers the host, runs its workers, reports their fate.

The agent is one ``elastic-run`` process. It holds the host's membership (a
lease in etcd), serves the TCPStore that rounds use when one of its workers is
rank 0, starts a worker when a plan gives it a rank, and turns what it sees
into membership changes:

* a worker crashed (killed, or died without a report): drop it from our member
  record at once, so survivors need not wait for any TTL; start a replacement
  while ``--max-restarts`` allows (it rejoins as a new worker);
* a worker stopped making progress (frozen, or its main thread stuck outside
  any collective; see watchdog.py): its stacks are logged, it is killed, and
  from there on it is a crashed worker;
* a worker failed with an error in user code: the job fails; no re-form loop;
* a worker finished: the training function returned, the job succeeded;
* SIGTERM/SIGINT: graceful leave. Our workers are withdrawn from membership,
  the ring switches without them at its next commit, they exit 0, we leave (or,
  when the leaving hosts together would leave fewer than min-np, the coordinator
  stops the whole job at one commit). A second signal, or the grace period
  running out, kills them instead;
* etcd away: what we report is queued (etcd_writes.py) and sent when it returns;
  a session lost to a partition registers us again when the link returns.

Workers that do not use the elastic API (a torchrun script) get torchrun's
semantics: on any change of round they are restarted together.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from elastic.rendezvous import (
    FAILED,
    RUNNING,
    STOPPING,
    SUCCEEDED,
    Etcd,
    JobKeys,
    JobStatus,
    MalformedValueError,
    Member,
    Participant,
    RendezvousError,
    RoundPlan,
    new_member_id,
)
from elastic.rendezvous.private_files import process_dir
from elastic.rendezvous.succession import Succession

from ..contract.agent_channel import ChannelBell, ChannelReader, RingBroke, RingFormed, Straggler, Told
from ..contract.events import EventLog
from ..contract.faults import NETWORK
from .budgets import AgentBudgets, Charge
from .chaos import ChaosMonkey
from .config import AgentConfig, config_for_worker
from .etcd_writes import EtcdWrites
from .event_tail import EventTail
from .fate import Action, Exit, Fate, View, fate
from .health import HealthServer, HealthState, SessionMonitor, SessionWatch
from .local_workers import LocalWorkers
from .metrics import AgentMetrics, round_change
from .outcome import exit_status
from .peer_probe import PeerProbe
from .plain_store import PlainStores, prune_round_keys
from .run_watch import RunWatch
from .store_server import StoreServer
from .straggler_eviction import verdict
from .watchdog import HangPolicy, Watchdog, device_floor
from .wind_down import wind_down
from .worker_env import worker_env
from .workers import Exited, WorkerProcess, WorkerTemplate, worker_output

log = logging.getLogger(__name__)

# A worker that has not called elastic.init() within this long after its start is a
# plain (torchrun-style) script; before that it may still be importing torch. Not one of
# the job's timeouts (contract/timeouts.py): it bounds a script's start, not a wait of the job.
_STARTUP_S = 60.0


@dataclass
class _Signal:
    signum: int


@dataclass
class AgentState:
    """Where this agent is in the job: the plan it acts on, whether it leaves, how it ended."""

    plan: Optional[RoundPlan] = None  # the newest plan acted on
    previous_plan: Optional[RoundPlan] = None  # the one before it
    leaving_since: Optional[float] = None  # time.monotonic() of the SIGTERM that started a graceful leave
    forced_leave: Optional[str] = None  # why a leave stopped being graceful
    outcome: Optional[int] = None  # the agent's exit status, once it ends

    @property
    def leaving(self) -> bool:
        return self.leaving_since is not None

    @property
    def round(self) -> int:
        return self.plan.round if self.plan is not None else 0


def follow_rounds(state: AgentState, steps: Iterable[Callable[[], None]]) -> None:
    """Act on the newest plan, one step after another. A step may read etcd (a
    torchrun-style worker's store address), so etcd being away, or a store never
    published, must not end the agent: the plan is then taken as not acted on, and the
    next turn acts on it again (starting the workers it wants that are not running)."""
    try:
        for step in steps:
            step()
    except RendezvousError as exc:
        state.plan = state.previous_plan
        log.warning("cannot follow the newest plan yet (%s); retrying", exc)


@dataclass
class Telemetry:
    """What the agent tells people and tools: events, metrics, the health endpoint's state,
    the run's progress and summary. Observation only: nothing here decides anything."""

    events: EventLog
    tail: EventTail  # the workers' events, for the metrics and the run's record
    metrics: AgentMetrics
    health: HealthState
    session_watch: SessionWatch
    run_watch: Optional[RunWatch] = None


@dataclass
class Services:
    """What ``run`` starts (and ``_teardown`` stops): the host's stores, its membership,
    its probes and health endpoints."""

    store: StoreServer  # the round store, when one of our workers is rank 0
    participant: Participant
    plain_stores: PlainStores
    peer_probe: PeerProbe  # can we reach our peers while our ring stalls?
    succession: Succession  # a ring of ours broke: is the coordinator's agent dead?
    health_server: Optional[HealthServer] = None
    session_monitor: Optional[SessionMonitor] = None
    channel_bell: Optional[ChannelBell] = None  # a worker told us something: act on it now


class Agent:
    def __init__(self, config: AgentConfig, etcd: Etcd):
        self.config = config
        self._etcd = etcd
        self._inbox: "queue.Queue" = queue.Queue()
        self.member_id = new_member_id(config.host_id)
        self.workers = LocalWorkers(self.member_id, config.nproc_per_node, WorkerTemplate.of(config))
        self.budgets = AgentBudgets(config.max_restarts, config.max_resets, config.reset_window)
        self.state = AgentState()
        self._etcd_writes = EtcdWrites()  # reports queued while etcd is away
        self._scratch = tempfile.mkdtemp(prefix="agent-", dir=process_dir())  # gone with us, even if SIGKILLed
        # What our workers tell us to act on (contract/agent_channel.py), in our scratch directory.
        self._channel = ChannelReader(os.path.join(self._scratch, "channel.jsonl"), config.host_id)
        # Without a log directory the events still go to a file: the agent reads its
        # workers' events from it for its metrics and the run's summary (event_tail.py).
        events = EventLog(os.path.join(config.log_dir or self._scratch, "events.jsonl"), host=config.host_id)
        timeouts = config.timeouts  # the job's, reviewed at launch; every worker gets the same
        health = HealthState(ttl=timeouts.ttl)
        metrics = AgentMetrics(config.host_id, self.member_id)  # fed by _observe and the watchdog's reads
        self.telemetry = Telemetry(
            events, EventTail(events.path, max_bytes=config.log_max_bytes), metrics, health,
            SessionWatch(health, events.emit, self.member_id),
        )
        # Progress for `elastic-run status`, the summary at the end, --chaos-kill-every's monkey (run_watch.py).
        chaos = ChaosMonkey(config.chaos, workers=self.workers.running, min_np=config.settings.min_np,
                            max_restarts=config.max_restarts, events=events, out=print) if config.chaos else None
        self.telemetry.run_watch = RunWatch(job_id=config.job_id, log_dir=config.log_dir,
                                            publish=self._publish_progress, chaos=chaos)
        policy = HangPolicy(timeout=timeouts.hang, device_floor=device_floor(config.backend, timeouts.collective))
        self._watchdog = Watchdog(policy, self._scratch, events, config.log_dir, on_marks=metrics.observe_marks)
        self.services: Optional[Services] = None

    @property
    def events(self) -> EventLog:
        return self.telemetry.events

    @property
    def participant(self) -> Participant:
        return self.services.participant

    # -- life ---------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.config
        # The store that rounds use when one of our workers is rank 0. It lives as
        # long as the agent, so a worker crash never takes the store down with it. It
        # serves at once, without torch (store_server.py).
        store = StoreServer(cfg.host_addr, "round-store",  # stopped for good (it says why): leave the job
                            on_failure=lambda why: self._inbox.put(_Signal(signal.SIGTERM)))
        health_server = None
        if cfg.health_port is not None:
            health_server = HealthServer(cfg.health_port, self.telemetry.health.probe,
                                         host=cfg.health_addr or cfg.host_addr,
                                         metrics=self.telemetry.metrics.exposition).start()
        member = Member(member_id=self.member_id, host=cfg.host_id, addr=cfg.host_addr, store_port=store.port,
                        workers=self.workers.offer(cfg.nproc_per_node), joined=time.time())
        participant = Participant(self._etcd, JobKeys(cfg.job_id), cfg.settings, member, ttl=cfg.ttl,
                                  on_round=self._on_round)
        participant.start()
        plain_stores = PlainStores(self._etcd, JobKeys(cfg.job_id), self.member_id, cfg.host_addr,
                                   job_lease=lambda: participant.control.job_lease)
        participant.control.add_listener(lambda plan, status: self._inbox.put("control"))
        succession = Succession(self._etcd, participant.keys, self.member_id, lambda: participant.control.plan,
                                cfg.timeouts.succession_patience)
        # Peers our probe cannot reach may be the coordinator's host, dead hard: whether it
        # is gone is the succession's to check, as for a ring that broke.
        peer_probe = PeerProbe(self._etcd, participant, self.events, self._watchdog.marks,
                               on_unreachable=succession.ring_broke).start()
        self.services = Services(store, participant, plain_stores, peer_probe, succession.start(), health_server,
                                 channel_bell=ChannelBell(self._channel.path, lambda: self._inbox.put("told")).start())
        self.telemetry.health.mark_registered()
        if health_server is not None:
            # The session's own verdict comes only after max(ttl, retry deadline);
            # the probe must fail once our lease has not been seen alive for a TTL.
            self.services.session_monitor = SessionMonitor(self.telemetry.health, self._lease_alive,
                                                           cfg.timeouts.ttl / 3).start()
        self.events.emit("agent_started", member=self.member_id, workers=len(self.workers.wanted))
        self.events.emit("member_joined", member=self.member_id)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, _f: self._inbox.put(_Signal(s)))
        try:
            return self._loop()
        finally:
            self.telemetry.run_watch.finish(self.telemetry.tail.read_new())  # the chaos report, if any; the summary
            self._teardown()

    def _loop(self) -> int:
        while self.state.outcome is None:
            self.telemetry.session_watch.check(self.participant.session)
            try:
                item = self._inbox.get(timeout=0.5)
            except queue.Empty:
                item = None
            if isinstance(item, Exited):
                self._on_exit(item)
            elif isinstance(item, _Signal):
                self._on_signal(item.signum)
            for told in self._channel.read_new():
                self._on_told(told)
            for event in self.telemetry.tail.read_new():
                self._observe(event)
            self._etcd_writes.flush()
            self._watchdog.check(self.workers.running, self.state.plan)  # a hung worker is killed; its exit next
            follow_rounds(self.state, (self._restart_plain_workers, self._follow_control, self._start_awaiting))
            self._check_grace()
        return self.state.outcome

    def _observe(self, event: dict) -> None:
        """An event of this host's workers or of the agent itself (in file order): observed, never acted on."""
        self.telemetry.metrics.observe(event)
        self.telemetry.run_watch.on_event(event)  # and the chaos monkey's

    def _on_told(self, told: Told) -> None:
        """A message of one of this host's workers (contract/agent_channel.py)."""
        match told.message:
            case RingBroke(round=failed_round):
                # Our ring broke: is the coordinator's agent gone? (rendezvous/succession.py)
                self.services.succession.ring_broke(failed_round)
            case Straggler() as message:
                self._on_straggler(told.worker, message)
            case RingFormed(round=formed_round):
                # Its survivors train: a join round no longer costs them their round.
                self.participant.coordinator.ring_formed(formed_round)
            case other:
                raise TypeError(f"agent: no way to act on {other!r}")

    # -- following the plan -----------------------------------------------------------
    def _follow_control(self) -> None:
        control = self.participant.control
        status, plan = control.status, control.plan
        if status.over:
            self._finish(status)
            return
        if status.state == STOPPING and not self.workers.any_alive():
            self.events.emit("job_finished", status=STOPPING, reason=status.reason)
            self.state.outcome = 0
            return
        if plan is None or (self.state.plan is not None and plan.round <= self.state.plan.round):
            return
        previous = self.state.plan
        self.state.previous_plan, self.state.plan = previous, plan
        self.events.round = plan.round
        self.events.emit("round_started", **round_change(previous, plan))
        if not self._script_is_elastic():  # a torchrun-style script needs a fresh store per round
            self.services.plain_stores.serve_if_rank0(plan)
        prune_round_keys(self.services.store.started(), plan.round)
        self._restart_plain_workers()
        mine = set(plan.local_ranks(self.member_id))
        for worker_id in self.workers.wanted:
            if worker_id in mine and worker_id not in self.workers.running and not self.state.leaving:
                self._start_worker(worker_id, plan)

    def _restart_plain_workers(self) -> None:
        """torchrun semantics for scripts without the elastic API: restart on a new round.

        A worker that has not called ``elastic.init()`` yet may just be slow to start
        (importing torch on a loaded host): when the round only grew, it counts as a
        plain script only once it has run for ``_STARTUP_S`` without doing so, and each
        turn looks again until then. After a crash its ring is broken either way: an
        elastic worker restarted that early loses nothing but its start-up.
        """
        plan = self.state.plan
        if plan is None or self.state.leaving:
            return
        mine = set(plan.local_ranks(self.member_id))
        for worker_id, proc in list(self.workers.running.items()):
            if not proc.alive or proc.elastic or proc.started_round >= plan.round or proc.stopping:
                continue
            broken = bool(plan.lost) or self.budgets.plain_round_failed(proc.started_round)
            if not broken and time.monotonic() - proc.started_at < _STARTUP_S:
                continue
            log.info("restarting %s for round %d (not an elastic worker)", worker_id, plan.round)
            proc.stop()
            if not proc.join(10):
                proc.kill()
            if proc.join(5):  # reaped: its device slot is free for its successor (else that waits)
                self.workers.slots.release(proc.pid)
            self.workers.remove(worker_id)
            if worker_id in mine:
                self._start_worker(worker_id, plan)

    def _start_worker(self, worker_id: str, plan: RoundPlan) -> None:
        cfg = self.config
        rank = plan.rank_of(worker_id)
        slot = self.workers.slots.claim(worker_id)  # None: started by _start_awaiting once a holder has exited
        if slot is None:
            return
        progress_file, stacks_file = self._watchdog.files_for(worker_id)
        worker_config = config_for_worker(  # etcd's endpoints now: a served etcd's members move (served.py)
            cfg, worker_id, plan.round, endpoints=self._etcd.config.describe(), member_id=self.member_id,
            events_file=self.events.path, agent_channel=self._channel.path, scratch=self._scratch,
            progress_file=progress_file, stacks_file=stacks_file,
            final_checkpoint_file=self._final_checkpoint_file(worker_id), device_slot=slot,
            restarted_all=self.budgets.restarts > 0
            and not any(p.elastic for p in self.workers.running.values() if p.alive),
        )
        env = worker_env(
            os.environ, plan=plan, worker_id=worker_id, member_id=self.member_id, nproc_per_node=cfg.nproc_per_node,
            master=self._torchrun_store(plan), worker_config=worker_config, socket_ifname=cfg.socket_ifname,
            restart_count=self.budgets.restarts, max_restarts=cfg.max_restarts, device_slot=slot,
            max_world_size=cfg.settings.max_np,  # NCCL's waits follow the largest world the job may reach
        )
        proc = WorkerProcess(
            worker_id,
            # The bootstrap ties the worker's life to ours (parent-death signal).
            [sys.executable, "-u", "-m", "elastic.worker.bootstrap", *cfg.command],
            env,
            started_round=plan.round,
            label=lambda w=worker_id: self._label(w),
            inbox=self._inbox,
            output=worker_output(cfg, worker_id),
            error_file=worker_config.error_file,
            marker_file=worker_config.marker_file,
            template=self.workers.template,
        )
        self.workers.slots.hold(slot, proc.pid, worker_id)
        self.workers.running[worker_id] = proc
        self.events.emit("worker_started", worker=worker_id, pid=proc.pid, rank=rank, round=plan.round, slot=slot)

    def _script_is_elastic(self) -> bool:
        """Our workers use the elastic runtime: seen by us (then told to the job, once), or
        by another agent of the job (plain_store.py)."""
        plain_stores = self.services.plain_stores
        if self.workers.script_is_elastic:
            plain_stores.say_elastic(self._etcd_writes.write)
            return True
        return plain_stores.job_is_elastic()

    def _torchrun_store(self, plan: RoundPlan) -> tuple[str, int]:
        """MASTER_ADDR:PORT for a worker of ``plan``. A torchrun-style script needs the
        round's fresh store, which rank 0's agent publishes (waited for, bounded:
        plain_store.py). An elastic worker never uses it (its rounds have their own
        store, the plan's): once the job's workers are known to be elastic, they start
        at once, told the plan's store."""
        address = None if self._script_is_elastic() else self.services.plain_stores.address(plan)
        if address is None:
            host, port = plan.store_addr.rsplit(":", 1)
            return host, int(port)
        return address

    def _start_awaiting(self) -> None:
        """Start the workers that waited for a device slot, once one is free."""
        plan = self.state.plan
        mine = set(plan.local_ranks(self.member_id)) if plan is not None else set()
        for worker_id in self.workers.slots.awaiting(
                lambda w: w in mine and w in self.workers.wanted and w not in self.workers.running
                and not self.state.leaving):
            self._start_worker(worker_id, plan)

    def _label(self, worker_id: str) -> str:
        plan = self.participant.control.plan if self.services is not None else None
        rank = plan.rank_of(worker_id) if plan is not None else None
        return f"rank{rank}" if rank is not None else worker_id

    def _on_round(self, plan: RoundPlan, reason: str) -> None:
        """Called in the coordinator's thread for each round it writes."""
        self.events.emit(
            "round_formed", round=plan.round, world_size=plan.world_size,
            members=len(plan.member_order()), reason=reason,
        )

    def _publish_progress(self, value: bytes) -> None:
        """The run's progress at the job's key (run_watch.py's thread), on the job's lease
        only: a value put after the job ended must not outlive it."""
        lease = self.participant.control.job_lease if self.services is not None else None
        if lease:
            self._etcd.put(JobKeys(self.config.job_id).progress, value, lease=lease)

    # -- what happened to a worker --------------------------------------------------------
    def _on_exit(self, exited: Exited) -> None:
        self.workers.slots.release(exited.pid)  # seen to exit: its slot may go to a new process
        proc = self.workers.running.get(exited.worker_id)
        if proc is None or proc.pid != exited.pid:
            return  # a process we replaced ourselves
        self._report_exit(exited)
        if proc.stopping and not self.state.leaving:
            return  # we restarted it ourselves
        self.workers.remove(exited.worker_id)
        self._watchdog.forget(exited.worker_id)
        exit = Exit(exited.worker_id, exited.exit_code, exited.signal, exited.record)
        charge = Charge.of(exit, network_round=self.state.round, plain_round=proc.started_round,
                           now=time.monotonic())
        status = self.participant.control.status
        decided = fate(exit, View(
            leaving=self.state.leaving,
            wanted=exited.worker_id in self.workers.wanted,
            job_ending=status.state == STOPPING or status.over,
            elastic=proc.elastic,
            lost_reason=proc.lost_reason,
            local_workers=self.config.nproc_per_node,
            budget=self.budgets.standing(charge),
        ))
        replacement = self._carry_out(decided, exit, charge)
        self.budgets.spend(decided, charge, replacement=replacement)

    def _carry_out(self, decided: Fate, exit: Exit, charge: Charge) -> Optional[str]:
        """Do what ``fate`` decided; the worker offered in the lost one's place, if any."""
        worker_id = exit.worker_id
        network = exit.fault is not None and exit.fault.kind == NETWORK
        match decided.action:
            case Action.IGNORE:
                pass
            case Action.SUCCEED:
                done = JobStatus(SUCCEEDED, decided.reason)  # the job is done for everyone
                self._etcd_writes.write("report the job succeeded", lambda: self.participant.set_status(done))
            case Action.FAIL:
                extra = dict(network=True, worker=worker_id) if network else dict(user_error=bool(decided.cause))
                self._ring_broke(decided.reason, **extra)
                failed = JobStatus(FAILED, decided.reason, cause=decided.cause)  # the cause sets every exit status
                self._etcd_writes.write("report the job failed", lambda: self.participant.set_status(failed))
            case Action.REPLACE | Action.DROP:
                self._ring_broke(decided.reason)
                # Dropped at once: the coordinator re-forms without waiting for any TTL.
                replacement = self.workers.replace(worker_id, with_new=decided.action == Action.REPLACE)
                wanted = tuple(self.workers.wanted)
                self._etcd_writes.write(f"drop worker {worker_id}", lambda: self.participant.set_workers(wanted))
                return replacement
            case Action.NETWORK_ROUND:
                # Not a crash: the worker stays wanted (it starts again in the next round)
                # and nobody is dropped, so the job does not bleed workers.
                log.warning("%s", decided.reason)
                self._ring_broke(decided.reason, network=True, worker=worker_id)
                self._ask_for_round(worker_id, charge.network_round, decided.reason)
            case Action.RESTART_PLAIN:
                self._ring_broke(decided.reason)  # torchrun semantics: every worker restarts
                self._ask_for_round(worker_id, charge.plain_round, decided.reason)
            case Action.NOTED:
                self._ring_broke(decided.reason)
            case other:
                raise TypeError(f"agent: no way to carry out {other!r}")
        return None

    def _ring_broke(self, reason: str, **fields) -> None:
        """A failure of ours, told (the events log), and our coordinator checked, as when a
        worker of ours tells us its ring broke (a torchrun-style worker cannot)."""
        self.events.emit("failure_detected", reason=reason, **fields)
        if self.services is not None:
            self.services.succession.ring_broke(self.state.round)

    def _ask_for_round(self, worker_id: str, failed_round: int, reason: str) -> None:
        self._etcd_writes.write(f"ask for a round after {failed_round}",
                                lambda: self.participant.control.request_reset(worker_id, failed_round, reason))

    def _on_straggler(self, worker_id: str, message: Straggler) -> None:
        """``--evict-stragglers``: our worker is a persistent straggler (straggler_eviction.py)."""
        plan = self.state.plan
        if not self.config.stragglers.evict or worker_id not in self.workers.running or self.state.leaving \
                or plan is None:
            return
        decided = verdict(message, plan, len(plan.local_ranks(self.member_id)), self.config.settings.min_np)
        if not decided.evict:
            log.warning("%s", decided.refusal(plan, worker_id, message.rank))
            return
        self.events.emit("straggler_evicted", worker=worker_id, ratio=message.ratio, remaining=decided.remaining,
                         min_np=decided.min_np)
        self._on_signal(signal.SIGTERM)  # the graceful leave, the same as a scale-down

    # -- leaving -------------------------------------------------------------------------
    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.state.leaving:
            log.warning("%s again: stopping workers now", name)
            self._force_leave(f"{name} again during the graceful leave")
            return
        self.state.leaving_since = time.monotonic()
        self.events.emit("graceful_leave", signal=name, grace_period=self.config.grace_period)
        # Withdraw our workers. Whether the ring goes on without them or the whole job
        # stops at a commit (with a final checkpoint) because too few would remain is
        # the coordinator's decision (rounds.decide): other hosts may be leaving too.
        self.workers.wanted = []
        self._etcd_writes.write("withdraw our workers", lambda: self.participant.set_workers((), draining=True))
        if not any(p.elastic for p in self.workers.running.values()):
            for proc in self.workers.running.values():
                proc.stop()

    def _check_grace(self) -> None:
        state = self.state
        if not state.leaving or state.outcome is not None:
            return
        if not self.workers.any_alive():
            stopping = self._job_status()
            # Left a job that goes on: --leave-exit-code (0 by default) lets a scheduler
            # tell this from the job's end (a Kubernetes Job then recreates the pod).
            state.outcome = self.config.leave_exit_code if stopping.state == RUNNING else 0
            if stopping.state == STOPPING:
                self.events.emit("job_finished", status=STOPPING, reason=stopping.reason)
            else:
                self.events.emit("member_left", member=self.member_id, graceful=state.forced_leave is None)
            return
        if state.forced_leave is None and time.monotonic() - state.leaving_since > self.config.grace_period:
            log.warning("grace period of %gs over: stopping workers", self.config.grace_period)
            self._force_leave(f"grace period of {self.config.grace_period:g}s over")

    def _job_status(self) -> JobStatus:
        """The job's status, read afresh: our workers may have acted on a stop that our
        own control watch has not delivered yet."""
        try:
            kv = self._etcd.get(self.participant.keys.status)
        except RendezvousError:
            return self.participant.control.status
        try:
            return JobStatus.from_json(kv.value) if kv is not None else self.participant.control.status
        except MalformedValueError:
            return self.participant.control.status  # the control channel said it once already

    def _force_leave(self, reason: str) -> None:
        """Kill our workers mid-step: for the ring this is a failure, not a leave."""
        self.state.forced_leave = reason
        alive = self.workers.alive()
        if alive:
            self._ring_broke(f"graceful leave forced: {reason}", workers=alive)
        for proc in self.workers.running.values():
            proc.kill()
        if alive and self.state.plan is not None:
            # The ring they were in may still be blocked on them; a round that names
            # them lost makes its survivors abort it now, not at the collective timeout.
            # Queued if etcd is away: the agent must still get on with leaving.
            failed_round, why = self.state.plan.round, f"graceful leave forced: {reason}"
            self._etcd_writes.write("ask for a round without our workers", lambda: (
                self.participant.control.request_reset(f"{self.member_id}.forced", failed_round, why, lost=alive)))

    def _finish(self, status: JobStatus) -> None:
        """The job is over: let our workers end (rank 0 may be writing the final
        checkpoint: see wind_down.py), then report how it ended."""
        wind_down(
            self.workers.running, self._inbox, succeeded=status.state == SUCCEEDED,
            final_timeout=self.config.final_checkpoint_timeout,
            writing=lambda w: os.path.exists(self._final_checkpoint_file(w)),
            label=self._label, on_exit=self._report_exit, is_signal=lambda item: isinstance(item, _Signal),
        )
        self.events.emit("job_finished", status=status.state, reason=status.reason)
        self.state.outcome = exit_status(status)
        if status.state != SUCCEEDED:
            print(f"elastic-run: job {self.config.job_id} failed: {status.reason}", file=sys.stderr)

    def _report_exit(self, item: Exited) -> None:
        plan = self.state.plan
        self.events.emit(
            "worker_exited", worker=item.worker_id, exit_code=item.exit_code, signal=item.signal,
            rank=plan.rank_of(item.worker_id) if plan else None,
        )

    def _lease_alive(self) -> bool:
        """Health check (monitor thread): is our member's lease alive in etcd?"""
        session = self.participant.session
        return session is not None and self._etcd.lease_time_to_live(session.lease_id) > 0

    def _teardown(self) -> None:
        for proc in self.workers.running.values():
            proc.kill()
            proc.join(5)
        self.workers.template.close()
        services = self.services
        if services is not None:
            services.participant.leave()
            for server in (services.session_monitor, services.peer_probe, services.succession,
                           services.health_server, services.channel_bell):  # threads we started
                if server is not None:
                    server.stop()
            services.plain_stores.close()
            services.store.close()
        shutil.rmtree(self._scratch, ignore_errors=True)

    def _final_checkpoint_file(self, worker_id: str) -> str:
        return os.path.join(self._scratch, f"{worker_id}.final-checkpoint")
