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
from typing import Optional

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

from .config import AgentConfig, config_for_worker
from .etcd_writes import EtcdWrites
from ..contract.events import EventLog
from ..contract.faults import Fault
from .device_slots import DeviceSlots
from ..contract.reset_budget import ResetBudget, RoundFailures
from .event_tail import EventTail
from .peer_probe import PeerProbe
from .plain_store import PlainStores, prune_round_keys
from .store_server import StoreServer
from .straggler_eviction import on_straggler_event
from .watchdog import HangPolicy, Watchdog, device_floor
from .wind_down import wind_down
from .health import HealthServer, HealthState, SessionMonitor, SessionWatch
from .metrics import AgentMetrics, round_change
from .fate import FAIL, NETWORK_ROUND, REPLACE, RESTART_PLAIN, SUCCEED, Exit, FaultHistory, View, fate
from .outcome import exit_status
from .run_watch import RunWatch
from .worker_env import worker_env
from .workers import Exited, WorkerProcess, worker_output

log = logging.getLogger(__name__)

# A worker that has not called elastic.init() within this long after its start is a
# plain (torchrun-style) script; before that it may still be importing torch.
_STARTUP_S = 60.0


@dataclass
class _Signal:
    signum: int


class Agent:
    def __init__(self, config: AgentConfig, etcd: Etcd, endpoints: str):
        self.config = config
        self._etcd = etcd
        self._endpoints = endpoints
        self._inbox: "queue.Queue" = queue.Queue()
        self._workers: dict[str, WorkerProcess] = {}
        self._wanted: list[str] = []  # worker ids we offer, in local order
        self._next_worker = 0
        self._slots = DeviceSlots(config.nproc_per_node)  # GPU index / LOCAL_RANK of each live process
        self._restarts = 0
        self._plan: Optional[RoundPlan] = None
        self._plan_started: Optional[RoundPlan] = None  # the plan before the one being acted on
        self._plain_failure_rounds: set[int] = set()
        self._faults = FaultHistory()  # broken processes' faults: one broken process, or every one?
        self._network_failures = RoundFailures(ResetBudget(config.max_resets, config.reset_window))  # could not connect
        self._leaving_since: Optional[float] = None
        self._outcome: Optional[int] = None
        self._etcd_writes = EtcdWrites()  # reports queued while etcd is away
        self._scratch = tempfile.mkdtemp(prefix="agent-", dir=process_dir())  # gone with us, even if SIGKILLed
        # Without a log directory the events still go to a file: the agent reads its
        # workers' events from it (event_tail.py).
        self.events = EventLog(
            os.path.join(config.log_dir or self._scratch, "events.jsonl"), host=config.host_id
        )
        self._event_tail = EventTail(self.events.path, max_bytes=config.log_max_bytes)
        self.health = HealthState(ttl=config.ttl)
        self.member_id = new_member_id(config.host_id)
        self._session_watch = SessionWatch(self.health, self.events.emit, self.member_id)
        self.metrics = AgentMetrics(config.host_id, self.member_id)  # fed by _on_event and the watchdog's reads
        policy = HangPolicy(timeout=config.hang_timeout,
                            device_floor=device_floor(config.backend, config.collective_timeout))
        self._watchdog = Watchdog(policy, self._scratch, self.events, config.log_dir,
                                  on_marks=self.metrics.observe_marks)
        self._health_server: Optional[HealthServer] = None
        self._session_monitor: Optional[SessionMonitor] = None
        self._forced_leave: Optional[str] = None  # why a leave stopped being graceful
        self._store: Optional[StoreServer] = None
        self._plain_stores: Optional[PlainStores] = None
        self._peer_probe: Optional[PeerProbe] = None
        self.participant: Optional[Participant] = None
        # Progress for `elastic-run status`, the summary at the end, --chaos-kill-every's monkey (run_watch.py).
        self._watch = RunWatch.of(self)

    # -- life ---------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.config
        # The store that rounds use when one of our workers is rank 0. It lives as
        # long as the agent, so a worker crash never takes the store down with it. It
        # serves at once, without torch (store_server.py).
        self._store = StoreServer(cfg.host_addr, "round-store")
        if cfg.health_port is not None:
            self._health_server = HealthServer(cfg.health_port, self.health.probe, host=cfg.health_addr or cfg.host_addr,
                                               metrics=self.metrics.exposition).start()
        self._wanted = [self._new_worker_id() for _ in range(cfg.nproc_per_node)]
        member = Member(
            member_id=self.member_id,
            host=cfg.host_id,
            addr=cfg.host_addr,
            store_port=self._store.port,
            workers=tuple(self._wanted),
            joined=time.time(),
        )
        self.participant = Participant(
            self._etcd, JobKeys(cfg.job_id), cfg.settings, member, ttl=cfg.ttl, on_round=self._on_round
        )
        self.participant.start()
        self._plain_stores = PlainStores(
            self._etcd, JobKeys(cfg.job_id), self.member_id, cfg.host_addr,
            job_lease=lambda: self.participant.control.job_lease,
        )
        self.participant.control.add_listener(lambda plan, status: self._inbox.put("control"))
        self._peer_probe = PeerProbe(self._etcd, self.participant, self.events).start()
        self.health.mark_registered()
        if self._health_server is not None:
            # The session's own verdict comes only after max(ttl, retry deadline);
            # the probe must fail once our lease has not been seen alive for a TTL.
            self._session_monitor = SessionMonitor(self.health, self._lease_alive, cfg.ttl / 3).start()
        self.events.emit("agent_started", member=self.member_id, workers=len(self._wanted))
        self.events.emit("member_joined", member=self.member_id)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, _f: self._inbox.put(_Signal(s)))
        try:
            return self._loop()
        finally:
            self._watch.finish(self._event_tail.read_new())  # the chaos report, if any; the run's summary
            self._teardown()

    def _loop(self) -> int:
        while self._outcome is None:
            self._session_watch.check(self.participant.session)
            try:
                item = self._inbox.get(timeout=0.5)
            except queue.Empty:
                item = None
            if isinstance(item, Exited):
                self._on_exit(item)
            elif isinstance(item, _Signal):
                self._on_signal(item.signum)
            for event in self._event_tail.read_new():
                self._on_event(event)
            self._etcd_writes.flush()
            self._watchdog.check(self._workers, self._plan)  # a hung worker is killed; its exit comes next
            self._peer_probe.tick(self._watchdog.marks())  # a stalled ring: can we reach our peers?
            self._follow_rounds()
            self._check_grace()
        return self._outcome

    def _on_event(self, event: dict) -> None:
        """An event of this host's workers or of the agent itself (in file order)."""
        self.metrics.observe(event)
        on_straggler_event(self, event)
        self._watch.on_event(event)  # and the chaos monkey's
        self._peer_probe.on_event(event)  # our ring broke: is the coordinator's agent gone? (succession.py)

    # -- following the plan -----------------------------------------------------------
    def _follow_rounds(self) -> None:
        """Act on the newest plan. Starting a worker reads etcd (a torchrun-style
        worker's store address), so etcd being away, or a store never published, must
        not end the agent: the plan is then taken as not acted on, and the next turn
        acts on it again (starting the workers it wants that are not running)."""
        try:
            self._restart_plain_workers()
            self._follow_control()
            self._start_awaiting()
        except RendezvousError as exc:
            self._plan = self._plan_started
            log.warning("cannot follow the newest plan yet (%s); retrying", exc)

    def _follow_control(self) -> None:
        control = self.participant.control
        status, plan = control.status, control.plan
        if status.over:
            self._finish(status)
            return
        if status.state == STOPPING and not any(p.alive for p in self._workers.values()):
            self.events.emit("job_finished", status=STOPPING, reason=status.reason)
            self._outcome = 0
            return
        if plan is None or (self._plan is not None and plan.round <= self._plan.round):
            return
        self._plan_started, self._plan = self._plan, plan
        self.events.round = plan.round
        self.events.emit("round_started", **round_change(self._plan_started, plan))
        self._plain_stores.serve_if_rank0(plan)
        prune_round_keys(self._store.started(), plan.round)
        self._restart_plain_workers()
        mine = set(plan.local_ranks(self.member_id))
        for worker_id in self._wanted:
            if worker_id in mine and worker_id not in self._workers and self._leaving_since is None:
                self._start_worker(worker_id, plan)

    def _restart_plain_workers(self) -> None:
        """torchrun semantics for scripts without the elastic API: restart on a new round.

        A worker that has not called ``elastic.init()`` yet may just be slow to start
        (importing torch on a loaded host): when the round only grew, it counts as a
        plain script only once it has run for ``_STARTUP_S`` without doing so, and each
        turn looks again until then. After a crash its ring is broken either way: an
        elastic worker restarted that early loses nothing but its start-up.
        """
        plan = self._plan
        if plan is None or self._leaving_since is not None:
            return
        mine = set(plan.local_ranks(self.member_id))
        for worker_id, proc in list(self._workers.items()):
            if not proc.alive or proc.elastic or proc.started_round >= plan.round or proc.stopping:
                continue
            broken = bool(plan.lost) or proc.started_round in self._plain_failure_rounds
            if not broken and time.monotonic() - proc.started_at < _STARTUP_S:
                continue
            log.info("restarting %s for round %d (not an elastic worker)", worker_id, plan.round)
            proc.stop()
            proc.join(10) or proc.kill()
            if proc.join(5):  # reaped: its device slot is free for its successor (else that waits)
                self._slots.release(proc.pid)
            self._workers.pop(worker_id)
            if worker_id in mine:
                self._start_worker(worker_id, plan)

    def _start_worker(self, worker_id: str, plan: RoundPlan) -> None:
        cfg = self.config
        rank = plan.rank_of(worker_id)
        slot = self._slots.claim(worker_id)  # None: started by _start_awaiting once a holder has exited
        if slot is None:
            return
        progress_file, stacks_file = self._watchdog.files_for(worker_id)
        worker_config = config_for_worker(  # etcd's endpoints now: a served etcd's members move (served.py)
            cfg, worker_id, plan.round, endpoints=self._etcd.config.describe(), member_id=self.member_id,
            events_file=self.events.path, scratch=self._scratch, progress_file=progress_file,
            stacks_file=stacks_file, final_checkpoint_file=self._final_checkpoint_file(worker_id), device_slot=slot,
            restarted_all=self._restarts > 0 and not any(p.elastic for p in self._workers.values() if p.alive))
        env = worker_env(
            os.environ, plan=plan, worker_id=worker_id, member_id=self.member_id, nproc_per_node=cfg.nproc_per_node,
            master=self._plain_stores.address(plan), worker_config=worker_config, socket_ifname=cfg.socket_ifname,
            restart_count=self._restarts, max_restarts=cfg.max_restarts, device_slot=slot,
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
        )
        self._slots.hold(slot, proc.pid, worker_id)
        self._workers[worker_id] = proc
        self.events.emit("worker_started", worker=worker_id, pid=proc.pid, rank=rank, round=plan.round, slot=slot)

    def _start_awaiting(self) -> None:
        """Start the workers that waited for a device slot, once one is free."""
        mine = set(self._plan.local_ranks(self.member_id)) if self._plan is not None else set()
        for worker_id in self._slots.awaiting(lambda w: w in mine and w in self._wanted and w not in self._workers
                                              and self._leaving_since is None):
            self._start_worker(worker_id, self._plan)

    def _label(self, worker_id: str) -> str:
        plan = self.participant.control.plan if self.participant else None
        rank = plan.rank_of(worker_id) if plan is not None else None
        return f"rank{rank}" if rank is not None else worker_id

    def _on_round(self, plan: RoundPlan, reason: str) -> None:
        """Called in the coordinator's thread for each round it writes."""
        self.events.emit(
            "round_formed", round=plan.round, world_size=plan.world_size,
            members=len(plan.member_order()), reason=reason,
        )

    # -- what happened to a worker --------------------------------------------------------
    def _on_exit(self, exited: Exited) -> None:
        self._slots.release(exited.pid)  # seen to exit: its slot may go to a new process
        proc = self._workers.get(exited.worker_id)
        if proc is None or proc.pid != exited.pid:
            return  # a process we replaced ourselves
        self._report_exit(exited)
        if proc.stopping and self._leaving_since is None:
            return  # we restarted it ourselves
        del self._workers[exited.worker_id]
        self._watchdog.forget(exited.worker_id)
        fault = exited.record.fault if exited.record is not None else None
        status = self.participant.control.status
        decided = fate(Exit(exited.worker_id, exited.exit_code, exited.signal, exited.record), View(
            leaving=self._leaving_since is not None,
            wanted=exited.worker_id in self._wanted,
            job_ending=status.state == STOPPING or status.over,
            elastic=proc.elastic,
            lost_reason=proc.lost_reason,
            replaced_fault=self._faults.replaced_fault(exited.worker_id),
            same_fault_workers=self._faults.ended(exited.worker_id, fault, time.monotonic()),
            local_workers=self.config.nproc_per_node,
        ))
        if decided.action == SUCCEED:
            done = JobStatus(SUCCEEDED, decided.reason)  # the job is done for everyone
            self._etcd_writes.write("report the job succeeded", lambda: self.participant.set_status(done))
        elif decided.action == NETWORK_ROUND:
            self._on_network_failure(exited.worker_id, decided.reason)
        elif decided.action == FAIL:
            self.events.emit("failure_detected", reason=decided.reason, user_error=bool(decided.cause))
            failed = JobStatus(FAILED, decided.reason, cause=decided.cause)  # the cause sets every agent's exit status
            self._etcd_writes.write("report the job failed", lambda: self.participant.set_status(failed))
        elif decided.action == RESTART_PLAIN:
            self._on_plain_failure(exited.worker_id, proc, decided.reason)
        elif decided.action == REPLACE:
            self._replace(exited.worker_id, decided.reason, fault)

    def _replace(self, worker_id: str, reason: str, fault: Optional[Fault]) -> None:
        """Drop a lost worker; offer a new one in its place within --max-restarts."""
        self.events.emit("failure_detected", reason=reason)
        self._wanted.remove(worker_id)
        if self._restarts < self.config.max_restarts:
            self._restarts += 1
            self._wanted.append(self._new_worker_id())
            self._faults.replaced(self._wanted[-1], fault)
        # Reported at once: the coordinator re-forms without waiting for any TTL.
        wanted = tuple(self._wanted)
        self._etcd_writes.write(f"drop worker {worker_id}", lambda: self.participant.set_workers(wanted))

    # -- [addressing] peers that cannot reach each other ------------------------------------
    def _on_network_failure(self, worker_id: str, reason: str) -> None:
        """The round's workers could not connect to each other. Not a crash: the worker
        stays wanted (it is started again in the next round), and nobody is dropped, so
        the job does not bleed workers. One line per failed round; beyond --max-resets such
        rounds within --reset-window (reset_budget.py) the job fails with that line."""
        failed_round = self._plan.round if self._plan is not None else 0
        within_budget = self._network_failures.spend(failed_round)
        if within_budget is None:
            return  # the round's other workers say the same
        log.warning("%s", reason)
        self.events.emit("failure_detected", reason=reason, network=True, worker=worker_id)
        if not within_budget:
            cfg = self.config
            failed = JobStatus(FAILED, f"{reason} ({self._network_failures.recent} rounds within {cfg.reset_window:g}s,"
                                       f" --max-resets {cfg.max_resets} per --reset-window)")
            self._etcd_writes.write("report the job failed", lambda: self.participant.set_status(failed))
            return
        self._etcd_writes.write(f"ask for a round after {failed_round}",
                         lambda: self.participant.control.request_reset(worker_id, failed_round, reason))

    def _on_plain_failure(self, worker_id: str, proc: WorkerProcess, how: str) -> None:
        """torchrun semantics: any failure restarts every worker, counted once per round."""
        failed_round = proc.started_round
        self.events.emit("failure_detected", reason=f"worker {worker_id} died ({how})")
        if failed_round in self._plain_failure_rounds:
            return
        self._plain_failure_rounds.add(failed_round)
        if self._restarts >= self.config.max_restarts:
            failed = JobStatus(FAILED, f"worker {worker_id} died ({how}); --max-restarts {self.config.max_restarts} used up")
            self._etcd_writes.write("report the job failed", lambda: self.participant.set_status(failed))
            return
        self._restarts += 1
        self._etcd_writes.write(f"ask for a round after {failed_round}", lambda: self.participant.control.request_reset(
            worker_id, failed_round, f"worker died ({how})"))

    # -- leaving -------------------------------------------------------------------------
    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._leaving_since is not None:
            log.warning("%s again: stopping workers now", name)
            self._force_leave(f"{name} again during the graceful leave")
            return
        self._leaving_since = time.monotonic()
        self.events.emit("graceful_leave", signal=name, grace_period=self.config.grace_period)
        # Withdraw our workers. Whether the ring goes on without them or the whole job
        # stops at a commit (with a final checkpoint) because too few would remain is
        # the coordinator's decision (rounds.decide): other hosts may be leaving too.
        self._wanted = []
        self._etcd_writes.write("withdraw our workers", lambda: self.participant.set_workers((), draining=True))
        if not any(p.elastic for p in self._workers.values()):
            for proc in self._workers.values():
                proc.stop()

    def _check_grace(self) -> None:
        if self._leaving_since is None or self._outcome is not None:
            return
        if not any(p.alive for p in self._workers.values()):
            stopping = self._job_status()
            # Left a job that goes on: --leave-exit-code (0 by default) lets a scheduler
            # tell this from the job's end (a Kubernetes Job then recreates the pod).
            self._outcome = self.config.leave_exit_code if stopping.state == RUNNING else 0
            if stopping.state == STOPPING:
                self.events.emit("job_finished", status=STOPPING, reason=stopping.reason)
            else:
                self.events.emit("member_left", member=self.member_id, graceful=self._forced_leave is None)
            return
        if self._forced_leave is None and time.monotonic() - self._leaving_since > self.config.grace_period:
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
        self._forced_leave = reason
        alive = [w for w, p in self._workers.items() if p.alive]
        if alive:
            self.events.emit("failure_detected", reason=f"graceful leave forced: {reason}", workers=alive)
        for proc in self._workers.values():
            proc.kill()
        if alive and self._plan is not None:
            # The ring they were in may still be blocked on them; a round that names
            # them lost makes its survivors abort it now, not at the collective timeout.
            # Queued if etcd is away: the agent must still get on with leaving.
            failed_round, why = self._plan.round, f"graceful leave forced: {reason}"
            self._etcd_writes.write("ask for a round without our workers", lambda: (
                self.participant.control.request_reset(f"{self.member_id}.forced", failed_round, why, lost=alive)))

    def _finish(self, status: JobStatus) -> None:
        """The job is over: let our workers end (rank 0 may be writing the final
        checkpoint: see wind_down.py), then report how it ended."""
        wind_down(
            self._workers, self._inbox, succeeded=status.state == SUCCEEDED,
            final_timeout=self.config.final_checkpoint_timeout,
            writing=lambda w: os.path.exists(self._final_checkpoint_file(w)),
            label=self._label, on_exit=self._report_exit, is_signal=lambda item: isinstance(item, _Signal),
        )
        self.events.emit("job_finished", status=status.state, reason=status.reason)
        self._outcome = exit_status(status)
        if status.state != SUCCEEDED:
            print(f"elastic-run: job {self.config.job_id} failed: {status.reason}", file=sys.stderr)

    def _report_exit(self, item: Exited) -> None:
        self.events.emit(
            "worker_exited", worker=item.worker_id, exit_code=item.exit_code, signal=item.signal,
            rank=self._plan.rank_of(item.worker_id) if self._plan else None,
        )

    def _lease_alive(self) -> bool:
        """Health check (monitor thread): is our member's lease alive in etcd?"""
        session = self.participant.session
        return session is not None and self._etcd.lease_time_to_live(session.lease_id) > 0

    def _teardown(self) -> None:
        for proc in self._workers.values():
            proc.kill()
            proc.join(5)
        if self.participant is not None:
            self.participant.leave()
        for server in (self._session_monitor, self._peer_probe, self._health_server):  # threads we started
            if server is not None:
                server.stop()
        if self._plain_stores is not None:
            self._plain_stores.close()
        if self._store is not None:
            self._store.close()
        shutil.rmtree(self._scratch, ignore_errors=True)

    def _final_checkpoint_file(self, worker_id: str) -> str:
        return os.path.join(self._scratch, f"{worker_id}.final-checkpoint")

    def _new_worker_id(self) -> str:
        worker_id = f"{self.member_id}.w{self._next_worker}"
        self._next_worker += 1
        return worker_id
