"""Hang detection, the agent's side: which of my workers stopped making progress?

The agent reads each worker's progress marks (``progress.py``: shared memory, no
etcd, no syscall per step) every time its loop wakes (at least every 0.5 s) and
``judge`` decides, as a pure function of the marks, the policy and the time:

* **frozen**: the heartbeat thread has been silent for longer than the bound,
  and the kernel says the process is stopped (``T``: SIGSTOP, a debugger) or
  its main thread is in an uninterruptible wait (``D``: a hung driver, NFS).
  Armed once the heartbeat has started, disarmed when the runtime shuts down.
  A process stopped by a signal (``T``) gets a shorter bound, ``stopped_floor``
  (1 s) or 3x its slowest interval: nothing healthy is ever in that state, and a
  heartbeat due every 0.25 s that has missed four says the stop is no blip. A
  traced stop (``t``: a debugger, ``py-spy dump``) and ``D`` (a slow disk can
  hold a healthy thread there for seconds) keep the full bound.
* **gil-held**: the heartbeat is silent but the process is not frozen: a thread
  holds the GIL. If one of its threads is running (``R``) it computes (a long C
  call that keeps the GIL, a ``gc.collect()``, a starved machine): healthy. If
  all sleep, a thread sleeps while holding the GIL, a deadlock: hung once the
  patient bound of a stuck main thread (below) has passed. Its stacks are shown
  (in its log) as soon as the heartbeat is late, once, without a kill: before
  its first step that bound is long, and a person should not wait for it to
  see where the worker is.
* **stuck**: the heartbeat goes on, but the main thread has been seen idle in
  user code (no CPU used: sleeping, blocked on a lock or a socket),
  continuously and without a progress mark, for longer than the bound.
  (``while True: sleep``, a deadlock.) Busy user code (an evaluation pass) is
  slow, not stuck, and never evicted. Judged only while the training function
  runs: set-up before it and whatever the script does after it are not steps.
* **device**: a GPU worker's device work has not completed for longer than the
  bound (the patient one before the first interval): a CUDA event recorded at a
  commit that a thread of the worker polls (``elastic/worker/device_watch.py``). A
  main thread spin-waiting on a hung kernel (``.item()``, a stream sync) looks
  busy or waiting, so only the device's own progress shows the hang. On NCCL the
  ranks whose collective waits for the hung one stop too: they are declared hung
  as well if their agents judge first (nothing tells a victim's pending kernel
  from the culprit's without the flight recorder).
* **a victim** is never declared hung: a main thread blocked inside a collective
  (``torch.distributed``, DDP's forward or backward, a CUDA sync) or in the
  runtime's own waits is waiting for a peer. When the culprit is killed, the
  round that names it lost makes the victims abort their ring at once.

The bound: ``--hang-timeout S`` fixes it (0 or ``off`` disables detection).
Otherwise it is ``max(floor, factor x the slowest interval between two progress
marks of a round)``, floor 5 s (1 s for a stopped process), factor 3; so a job
whose commits come every 30 s is given 90 s. Until a worker has shown one such interval, a main thread in
user code gets ``first_interval`` (300 s): the first steps of a job may be slow
for reasons of their own (compilation, caches, an honest 30 s step), while the
heartbeat rule already holds.

A worker declared hung is asked for the stack of every thread (SIGUSR1 to
faulthandler), given ``grace`` seconds to write it (none when it is stopped: it
cannot run the handler), then killed with SIGKILL (which works on a stopped
process too); its exit is then reported like a crash. A worker whose torch has NCCL
also writes its NCCL flight recorder on that signal (``progress.NcclTrace``): within
the same ``grace`` the agent waits for it too, and keeps it beside the worker's log
(``worker-<id>.nccl-trace``) for whoever looks for the rank a GPU hang began on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..contract.devices import uses_nccl
from ..contract.events import EventLog
from ..contract.progress import Marks, ProgressBoard, nccl_trace_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HangPolicy:
    timeout: Optional[float] = None  # a fixed bound (s); None: derived; 0: detection off
    floor: float = 5.0
    # The floor for a process stopped by a signal (state T), which cannot be a healthy
    # slow step: a frozen worker is then replaced within about 1.5 s (issue 41's goal: 2 s
    # on a 50-70 ms step, no option set). The heartbeat beats every 0.25 s.
    stopped_floor: float = 1.0
    factor: float = 3.0
    first_interval: float = 300.0  # bound for a stuck main thread before any interval was seen
    grace: float = 1.0  # seconds a worker gets to dump its stacks before SIGKILL
    # The least a derived bound on pending device work may be: on NCCL a worker waiting in
    # a collective for a slow but healthy peer (rank 0 evaluating or saving alone) has
    # device work pending as long as that peer is away, like a hung device. Its ring's own
    # timeout ends that wait (a ring failure, re-formed), so the verdict waits for it.
    device_floor: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.timeout != 0

    def bound(self, slowest: float, *, stuck: bool) -> float:
        if self.timeout is not None:
            return self.timeout
        if stuck and slowest <= 0:
            return max(self.floor, self.first_interval)
        return max(self.floor, self.factor * slowest)

    def stopped_bound(self, slowest: float) -> float:
        """The bound for a process the kernel says is stopped by a signal (``T``)."""
        if self.timeout is not None:
            return self.timeout
        return max(self.stopped_floor, self.factor * slowest)

    def state_due(self, slowest: float) -> float:
        """Heartbeat silence after which the process's state is worth reading: the
        shortest bound any state can be judged by."""
        return min(self.stopped_bound(slowest), self.bound(slowest, stuck=False))

    def device_bound(self, slowest: float) -> float:
        if self.timeout is not None:
            return self.timeout
        return max(self.bound(slowest, stuck=True), self.device_floor)


def device_floor(backend: str, collective_timeout: float) -> float:
    """``HangPolicy.device_floor`` for workers of ``backend``: past the collective timeout
    on NCCL (gpu review G3); nothing on gloo, whose collectives leave no device work."""
    return collective_timeout + 5.0 if uses_nccl(backend) else 0.0


@dataclass(frozen=True)
class Verdict:
    hung: bool
    kind: str = ""  # "frozen", "gil-held", "device" or "stuck"
    stalled_s: float = 0.0  # seconds since the last progress mark
    timeout_s: float = 0.0  # the bound that was exceeded
    where: str = ""


HEALTHY = Verdict(False)


FROZEN_STATES = frozenset("TtD")  # /proc/<pid>/stat: stopped, traced, uninterruptible wait
RUNNING = "R"
STOPPED = frozenset("Tt")
SIGNAL_STOPPED = "T"  # SIGSTOP/SIGTSTP; "t" is a tracer's stop, which a person may be behind


def judge(marks: Marks, policy: HangPolicy, now: float, proc_state: str = "") -> Verdict:
    """Is this worker hung? Data in, verdict out (see the module docstring).

    ``proc_state`` is the kernel's state letter of the main thread, or "R" if
    any thread runs (see ``_proc_state``); read only once the heartbeat is late
    ("" when unknown: then a late heartbeat counts as frozen).
    """
    if not policy.enabled or marks.beats == 0:
        return HEALTHY
    stalled = now - marks.progress_at
    silent = now - marks.alive_at
    last = f", last seen at {marks.where}" if marks.where else ""
    if proc_state == SIGNAL_STOPPED and silent > policy.stopped_bound(marks.slowest):
        return Verdict(True, "frozen", stalled, policy.stopped_bound(marks.slowest),
                       f"no heartbeat for {silent:.1f}s (state T){last}")
    bound = policy.bound(marks.slowest, stuck=False)
    if silent > bound:
        if not proc_state or proc_state in FROZEN_STATES:
            return Verdict(True, "frozen", stalled, bound,
                           f"no heartbeat for {silent:.1f}s (state {proc_state or '?'}){last}")
        if proc_state == RUNNING:
            return HEALTHY
        bound = policy.bound(marks.slowest, stuck=True)
        if silent > bound:
            return Verdict(True, "gil-held", stalled, bound, f"no heartbeat for {silent:.1f}s{last}")
    if marks.progress and marks.device_since:
        bound = policy.device_bound(marks.slowest)
        pending = now - marks.device_since
        if pending > bound:
            return Verdict(True, "device", stalled, bound, f"device work queued {pending:.1f}s ago has not completed"
                           + (f"; main thread at {marks.where}" if marks.where else ""))
    if marks.progress and marks.user_since:
        bound = policy.bound(marks.slowest, stuck=True)
        if now - max(marks.user_since, marks.progress_at) > bound:
            return Verdict(True, "stuck", stalled, bound, marks.where)
    return HEALTHY


class Watchdog:
    """Reads the boards of the agent's workers; kills the ones ``judge`` declares hung."""

    # A longer gap between two checks means the agent itself was not running (a paused
    # VM, SIGSTOP of the agent and its workers): every heartbeat looks old then, and the
    # workers' heartbeat threads need a moment (a beat) to run again. Silence that the
    # agent could not watch is no evidence: each worker's clock starts again from the
    # end of the gap, so it is hung only if it stays silent a whole bound after that.
    _BLIND_GAP = 2.0

    def __init__(self, policy: HangPolicy, scratch: str, events: EventLog, log_dir: Optional[str],
                 *, clock: Callable[[], float] = time.monotonic,
                 on_marks: Optional[Callable[[dict, object], None]] = None):
        self.policy = policy
        self._on_marks = on_marks  # (marks by worker, plan) of each check: the agent's metrics
        self._scratch = scratch
        self._events = events
        self._log_dir = log_dir
        self._clock = clock
        self._boards: dict[str, ProgressBoard] = {}
        # The peer probe's thread reads the boards too (``marks``), between the agent
        # thread's adding and closing them.
        self._boards_lock = threading.Lock()
        self._handled: set[int] = set()  # pids already declared hung
        self._warned: set[int] = set()  # pids whose stacks were shown for a silent heartbeat
        self._last_check: Optional[float] = None
        self._watching_since = 0.0  # the end of the agent's last blind gap

    def files_for(self, worker_id: str) -> tuple[Optional[str], Optional[str]]:
        """(board, stacks) paths for a worker about to start; (None, None) when off."""
        if not self.policy.enabled:
            return None, None
        board = os.path.join(self._scratch, f"{worker_id}.progress")
        stacks = os.path.join(self._scratch, f"{worker_id}.stacks")
        self.forget(worker_id)
        ProgressBoard.create(board)
        with self._boards_lock:
            self._boards[worker_id] = ProgressBoard(board, writable=False)
        return board, stacks

    def forget(self, worker_id: str) -> None:
        with self._boards_lock:
            board = self._boards.pop(worker_id, None)
            if board is not None:
                board.close()

    def marks(self) -> list[Marks]:
        """Every live board's marks, for the peer probe's stall check (any thread)."""
        with self._boards_lock:
            return [board.read() for board in self._boards.values()]

    def check(self, workers: dict, plan) -> list[str]:
        """Judge every live worker; kill the hung ones. Returns their ids."""
        if not self.policy.enabled:
            return []
        now = self._clock()
        last, self._last_check = self._last_check, now
        if last is not None and now - last > self._BLIND_GAP:
            self._watching_since = now
            return []
        hung, suspects, read = [], [], {}
        for worker_id, proc in workers.items():
            board = self._boards.get(worker_id)
            if board is None or proc.pid in self._handled or not proc.alive:
                continue
            marks = read[worker_id] = board.read()
            marks = _seen_since(marks, self._watching_since)
            silent = now - marks.alive_at
            late = marks.beats and silent > self.policy.bound(marks.slowest, stuck=False)
            state = _proc_state(proc.pid) if marks.beats and silent > self.policy.state_due(marks.slowest) else ""
            verdict = judge(marks, self.policy, now, state)
            if verdict.hung:
                hung.append((worker_id, proc, verdict, state))
            elif late and state != RUNNING and proc.pid not in self._warned:  # "", T, D: hung above
                suspects.append((worker_id, proc, now - marks.alive_at))
        if self._on_marks is not None:
            self._on_marks(read, plan)
        if hung:
            self._evict(hung, plan)
        if suspects:
            self._warn(suspects, plan)
        return [w for w, *_ in hung]

    def _evict(self, hung: list, plan) -> None:
        for _, proc, _, _ in hung:
            self._handled.add(proc.pid)
        dumps = self._ask_stacks([(w, proc, state) for w, proc, _, state in hung])
        for worker_id, proc, verdict, state in hung:
            proc.lost_reason = f"declared hung: {verdict.kind}, no progress for {verdict.stalled_s:.1f}s"
            proc.signal(signal.SIGKILL)
            rank = plan.rank_of(worker_id) if plan is not None else None
            round_ = plan.round if plan is not None else None
            dump = dumps[worker_id]
            where = verdict.where or "unknown"
            shown = self._keep_stacks(worker_id, f"(rank {rank}), declared hung", dump)
            trace = self._keep_nccl_trace(worker_id)
            self._events.emit(
                "hang_detected", worker=worker_id, rank=rank, round=round_, kind=verdict.kind,
                stalled_s=round(verdict.stalled_s, 2), timeout_s=round(verdict.timeout_s, 2), where=where,
                stacks=shown,
            )
            log.warning(
                "worker %s (rank %s, round %s) hung (%s): no progress for %.1fs (timeout %.1fs) at %s; %s; killed",
                worker_id, rank, round_, verdict.kind, verdict.stalled_s, verdict.timeout_s, where,
                (f"stacks in {shown}" if dump else (
                    "no stacks (a stopped process cannot answer)" if state in STOPPED
                    else f"no stacks within {self.policy.grace:g}s (a frozen process cannot answer)"))
                + (f", NCCL flight recorder in {trace}" if trace else ""),
            )

    def _warn(self, suspects: list, plan) -> None:
        """Heartbeat silent, no thread running: a thread that sleeps holding the GIL. That
        is judged with the patient bound (CUDA's initialisation can look like it), but a
        deadlock looks like it too: show the stacks now, once, so that a person need not
        wait for the verdict to see where it is."""
        for _, proc, _ in suspects:
            self._warned.add(proc.pid)
        dumps = self._ask_stacks(suspects, nccl_traces=False)  # its silent heartbeat would write none
        for worker_id, proc, silent in suspects:
            rank = plan.rank_of(worker_id) if plan is not None else None
            shown = self._keep_stacks(worker_id, f"(rank {rank}), heartbeat silent {silent:.1f}s", dumps[worker_id])
            self._events.emit("hang_suspected", worker=worker_id, rank=rank, silent_s=round(silent, 2), stacks=shown)
            log.warning(
                "worker %s (rank %s): no heartbeat for %.1fs and no thread running (a thread sleeps holding the "
                "GIL); %s; declared hung if it lasts %.0fs", worker_id, rank, silent,
                f"stacks in {shown}" if shown else "no stacks", self.policy.bound(0.0, stuck=True))

    def _ask_stacks(self, entries: list, nccl_traces: bool = True) -> dict:
        """{worker id: its stacks, or ""} for (worker id, process, kernel state) triples."""
        return ask_stacks({w: (proc.pid, os.path.join(self._scratch, f"{w}.stacks"), state not in STOPPED)
                           for w, proc, state in entries}, self.policy.grace, self._clock, nccl_traces=nccl_traces)

    def _keep_nccl_trace(self, worker_id: str) -> Optional[str]:
        """Move the NCCL flight recorder a hung worker wrote for the kill out of the scratch
        directory (gone with the agent) to beside its log; where it went, or None."""
        trace = nccl_trace_path(os.path.join(self._scratch, f"{worker_id}.stacks"))
        if not self._log_dir or _size(trace) == 0:  # none announced, or not written in time
            return None
        kept = os.path.join(self._log_dir, f"worker-{worker_id}.nccl-trace")
        try:
            shutil.move(trace, kept)
        except OSError:
            return None
        return kept

    def _keep_stacks(self, worker_id: str, why: str, dump: str) -> Optional[str]:
        """Put the dump where the user looks: the worker's log, else the console."""
        if not dump:
            return None
        header = f"--- stacks of worker {worker_id} {why} ---\n"
        if self._log_dir:
            path = os.path.join(self._log_dir, f"worker-{worker_id}.log")
            with open(path, "a") as f:
                f.write(header + dump)
            return path
        sys.stderr.write(header + dump)
        return "stderr"


def ask_stacks(targets: dict, grace: float, clock: Callable[[], float] = time.monotonic, *,
               nccl_traces: bool = True) -> dict:
    """Every thread's stack of some workers, from the faulthandler that elastic/contract/progress.py
    registers for SIGUSR1 (it writes without the GIL, so a deadlocked worker answers too).

    ``targets`` maps a key to (pid, the worker's stacks file, whether it can answer: a
    stopped process runs no handler before SIGCONT, so it is not waited for). Waits up to
    ``grace`` seconds in all; returns {key: the dump written now, or ""}. Earlier dumps
    stay in the file: only what follows them is read. A worker that announced an NCCL
    flight recorder (``progress.NcclTrace``: its file exists) is also waited for until
    that file is replaced, within the same ``grace`` (unless ``nccl_traces`` is False):
    written by its heartbeat thread a moment after the stacks, it would otherwise die
    with the SIGKILL that follows."""
    before = {key: _size(path) for key, (_, path, _) in targets.items()}
    traces = {key: _identity(nccl_trace_path(path)) if nccl_traces else None for key, (_, path, _) in targets.items()}
    answering = []
    for key, (pid, _, answers) in targets.items():
        if not answers:
            continue
        try:
            os.kill(pid, signal.SIGUSR1)  # the worker alone, not its children
            answering.append(key)
        except ProcessLookupError:
            pass
    deadline = clock() + grace

    def answered(key) -> bool:
        path = targets[key][1]
        announced = traces[key] is not None
        return _size(path) > before[key] and (not announced or _identity(nccl_trace_path(path)) != traces[key])

    while answering and clock() < deadline and not all(answered(k) for k in answering):
        time.sleep(0.02)
    if answering:
        time.sleep(0.05)  # a dump that started is written in one go; let it end
    return {key: _read(path, before[key]) for key, (_, path, _) in targets.items()}


def _seen_since(marks: Marks, since: float) -> Marks:
    """``marks`` judged as if the worker had shown life at ``since`` (the agent was blind before)."""
    if marks.alive_at >= since and marks.progress_at >= since and (not marks.device_since or marks.device_since >= since):
        return marks
    return dataclasses.replace(marks, alive_at=max(marks.alive_at, since), progress_at=max(marks.progress_at, since),
                               user_since=max(marks.user_since, since) if marks.user_since else 0.0,
                               device_since=max(marks.device_since, since) if marks.device_since else 0.0)


def _proc_state(pid: int) -> str:
    """The main thread's state letter (T, D, S, ...), or R if any thread runs."""
    states = []
    try:
        tids = [pid] + [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    except OSError:
        return ""
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        states.append(stat[stat.rindex(")") + 2:][:1])
    if not states:
        return ""
    if states[0] not in ("T", "t") and RUNNING in states:
        return RUNNING
    return states[0]


def _identity(path: str) -> Optional[tuple]:
    """What changes when ``path`` is replaced (a rename onto it), or None if there is no file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str, offset: int = 0) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""
