"""``elastic-run --chaos-kill-every SECONDS``: kill our own workers, then say how it went.

A user's way to test a script's resilience before production. A thread of the
agent SIGKILLs one of this agent's workers at random intervals, uniform between
0.5x and 1.5x the mean (``--chaos-seed`` repeats a sequence), and at the end the
agent prints a recovery report: for each kill, how long the survivors took to
notice, the phases of the re-formation that followed, the time to the next step,
and how many steps were done again after the rollback.

A kill waits for a steady ring: every candidate must have reported steps in the
newest round (so kills never land in the middle of a re-formation or before
training starts), and the job must survive it: either a replacement is allowed
(``--max-restarts`` not used up by our kills) or the world stays >= ``--min-np``.
The kill is the same as ``kill -9`` from outside: the agent's own handling of the
exit (report, replacement) is the one a real crash gets.

The report is built from the events the agent saw (its own and its workers',
``Agent._observe``) with the timeline model, by a pure function
(``build_report``).
"""

from __future__ import annotations

import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..timeline.model import build

_RETRY_S = 0.2  # while no worker is ready to be killed, look again this often
_KEPT_EVENTS = frozenset({
    "agent_started", "worker_started", "worker_exited", "failure_detected", "hang_detected",
    "reform_done", "steps", "round_formed", "chaos_kill",
})


@dataclass(frozen=True)
class ChaosConfig:
    kill_every: float  # mean seconds between two kills
    seed: Optional[int] = None


@dataclass(frozen=True)
class Kill:
    time: float  # wall clock
    worker: str
    pid: int
    rank: Optional[int]


@dataclass(frozen=True)
class KillReport:
    at: float  # seconds since the agent's first event
    worker: str
    rank: Optional[int]
    recovered: bool
    detect_s: Optional[float] = None  # the kill until the first survivor noticed
    phases: Optional[dict] = None  # abort/rendezvous/pg init/sync of the last worker to finish
    total_s: Optional[float] = None  # the kill until the ring trains again
    steps_rerun: Optional[int] = None  # commits done again after the rollback
    round: Optional[int] = None
    world_size: Optional[int] = None


def build_report(kills: Sequence[Kill], events: Sequence[dict]) -> list[KillReport]:
    """For each kill, what the events say about the recovery it caused."""
    if not kills:
        return []
    timeline = build(list(events) + [{"time": k.time, "event": "chaos_kill", "worker": k.worker} for k in kills])
    out = []
    for kill in kills:
        at = kill.time - timeline.t0
        failure = next((f for f in timeline.failures if f.worker == kill.worker and f.time >= at - 1.0), None)
        reform = timeline.recovery_of(failure) if failure is not None else None
        if reform is None:
            out.append(KillReport(at, kill.worker, kill.rank, recovered=False))
            continue
        last = max(reform.workers, key=lambda w: w.done)
        noticed = min(w.detected for w in reform.workers)
        reached, resumed = timeline.steps_before(noticed), reform.resumed_commit
        out.append(KillReport(
            at, kill.worker, kill.rank, recovered=True,
            detect_s=max(0.0, noticed - at),
            phases={"abort": last.abort, "rendezvous": last.rendezvous, "pg init": last.pg_init, "sync": last.sync},
            total_s=reform.end - at,
            steps_rerun=max(0, reached - resumed) if reached is not None and resumed is not None else None,
            round=reform.round, world_size=reform.world_size,
        ))
    return out


def format_report(reports: Sequence[KillReport]) -> str:
    if not reports:
        return "chaos: no worker was killed (the job ended first, or no kill would have left it running)"
    recovered = [r for r in reports if r.recovered]
    head = f"chaos: {len(reports)} kill{'s' * (len(reports) > 1)}, {len(recovered)} recovered"
    if recovered:
        totals = [r.total_s for r in recovered]
        head += f"; to the next step: median {statistics.median(totals):.3f} s, max {max(totals):.3f} s"
    lines = [head, "  #    at s  worker (rank)                 detect   abort  rendezv  pg init    sync   total"
                   "  re-run  -> round, world"]
    for i, r in enumerate(reports, 1):
        who = f"{r.worker} ({r.rank})" if r.rank is not None else r.worker
        if not r.recovered:
            lines.append(f"  {i:<2} {r.at:6.1f}  {who:<28}  no re-formation seen (the job ended, or it was the last)")
            continue
        p = r.phases
        rerun = "?" if r.steps_rerun is None else str(r.steps_rerun)
        lines.append(f"  {i:<2} {r.at:6.1f}  {who:<28} {r.detect_s:7.3f} {p['abort']:7.3f} {p['rendezvous']:8.3f}"
                     f" {p['pg init']:8.3f} {p['sync']:7.3f} {r.total_s:7.3f}  {rerun:>6}  -> {r.round}, {r.world_size}")
    return "\n".join(lines)


class ChaosMonkey:
    """The killing thread and what it needs to know to pick a victim."""

    def __init__(self, config: ChaosConfig, *, workers: dict, min_np: int, max_restarts: int, events,
                 out: Callable[[str], None]):
        self._config = config
        self._workers = workers  # the agent's own dict: worker id -> WorkerProcess
        self._min_np = min_np
        self._max_restarts = max_restarts
        self._events = events
        self._out = out
        self._random = random.Random(config.seed)
        self._lock = threading.Lock()
        self._seen: list[dict] = []
        self._round = 0  # the newest round any event named
        self._steady: dict[str, int] = {}  # worker id -> round of its newest steps event
        self._world = 0
        self._ranks: dict[str, int] = {}
        self.kills: list[Kill] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-chaos", daemon=True)

    # -- the agent's calls -------------------------------------------------------------
    def on_event(self, event: dict) -> None:
        kind = event.get("event")
        if kind not in _KEPT_EVENTS:
            return
        with self._lock:
            self._seen.append(event)
            round_ = event.get("round")
            if isinstance(round_, int) and kind != "steps":
                self._round = max(self._round, round_)
            worker = event.get("worker")
            if kind == "steps" and worker and isinstance(round_, int):
                self._round = max(self._round, round_)
                self._steady[worker] = round_
                self._world = int(event.get("world_size") or self._world)
                if event.get("rank") is not None:
                    self._ranks[worker] = event["rank"]
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def finish(self, last_events: Sequence[dict] = ()) -> str:
        """Stop killing; the report (also printed)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        for event in last_events:
            self.on_event(event)
        with self._lock:
            report = format_report(build_report(self.kills, self._seen))
        self._out(report)
        return report

    # -- the thread ------------------------------------------------------------------------
    def next_delay(self) -> float:
        return self._random.uniform(0.5, 1.5) * self._config.kill_every

    def _run(self) -> None:
        while not self._stop.wait(self.next_delay()):
            while not self._stop.is_set():
                if self._kill_one():
                    break
                self._stop.wait(_RETRY_S)

    def _kill_one(self) -> bool:
        with self._lock:
            replaceable = len(self.kills) < self._max_restarts
            if not replaceable and self._world - 1 < self._min_np:
                return False
            ready = [(w, p) for w, p in list(self._workers.items())
                     if p.alive and not p.stopping and self._steady.get(w) == self._round]
            if not ready:
                return False
            worker, proc = self._random.choice(sorted(ready, key=lambda item: item[0]))
            kill = Kill(time.time(), worker, proc.pid, self._ranks.get(worker))
            self.kills.append(kill)
            self._steady.pop(worker, None)
        # Not proc.kill(): that marks the exit as ours, and the agent would not treat it as a crash.
        proc.signal(signal.SIGKILL)
        self._events.emit("chaos_kill", worker=worker, pid=kill.pid, rank=kill.rank)
        return True
