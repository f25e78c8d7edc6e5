"""Stragglers: which worker makes every step of the ring slow?

In synchronous SGD every rank's step takes as long as the slowest rank's: the fast
ones wait for it in the gradient all-reduce. Wall time per step is therefore the
same everywhere and says nothing; what differs is the time *outside* collectives.

What is measured (per worker, per commit interval)
    ``step_s``     wall time between two commits (the first commit of a round is
                   the start: the interval before it holds the re-formation).
    ``compute_s``  ``step_s`` minus the time the main thread was waiting on peers.
                   A ``WaitClock`` thread samples the main thread every ~50 ms
                   (jittered, so it cannot alias with a periodic step). Between two
                   samples, the time the main thread was *blocked* (neither running
                   nor waiting for a CPU, from the kernel's per-thread scheduler
                   statistics) counts as waiting on peers when its innermost frame
                   is in torch.distributed, DDP (torch.nn.parallel), the autograd
                   engine or this runtime. Both are needed: DDP's backward computes
                   and waits for the all-reduce in the same autograd frame, and only
                   the scheduler tells the two apart; a ``time.sleep`` or a slow read
                   in user code is blocked but outside collectives, so it counts as
                   compute (it makes the others wait just the same).
    Why sampling: the runtime does not own the user's DDP wrapper, so it cannot
    time the all-reduce wait from inside (a comm hook would take the user's one
    slot), and torch offers no completion hook for gloo work. The cost is one
    clock read per sample, and a frame walk when the main thread was blocked,
    outside the main thread: at 20 samples a second about 0.1-0.2% of a core
    (every 10 ms it was 2.2% per worker, mostly taking the GIL from the main thread:
    4.5% of a 2-core host with 4 workers; issue 30).
    Limits: it is a sample (its error shrinks with the window's length); the
    attribution of a stretch goes by the frame seen at its end; with NCCL the GPU
    waits are invisible from the CPU, so scores stay near 1.

At commits of a round chosen alike on every rank the ranks exchange their window's
wall and waiting seconds with one all_gather of two floats per rank (the commits of
a ring are in lockstep), so it cannot deadlock; if it raises, the ring is broken
like after any collective and the recovery path takes over. The first exchange
comes ``WINDOW_COMMITS`` commits after the round's first; each exchange schedules
the next from the gathered figures (hence alike everywhere): as many commits as
span ``TARGET_WINDOW_S`` at the pace just seen, at least ``WINDOW_COMMITS``. The
exchange is a barrier that absorbs the ranks' skew (measured: about 9 ms on 4
workers sharing 2 cores), so with short steps it must not come every few commits:
that alone cost about 1 ms per commit. A window closes at an exchange once it
spans ``MIN_WINDOW_S`` on every rank (short steps would give a few samples: a
noisy figure); every rank then emits
``step_times`` with its own figures and its ``straggler_score``
(own compute_s / median over the ranks). A worker whose score exceeds
``--straggler-ratio`` in ``PERSISTENT_WINDOWS`` windows in a row emits
``straggler_detected``, tells its agent (``contract/agent_channel.py``) and logs one
line naming its host and rank; with ``--evict-stragglers`` that agent leaves
gracefully (``agent/straggler_eviction.py``).
"""

from __future__ import annotations

import logging
import math
import os
import random
import statistics
import threading
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..contract.agent_channel import Straggler
from ..contract.progress import WAITING, classify, main_thread_frames, stdlib_prefixes
from ..contract.straggler_policy import remaining_after

log = logging.getLogger(__name__)

WINDOW_COMMITS = 10  # commits to the first exchange of a round, and the fewest between two
MIN_WINDOW_S = 1.0  # a window closes at an exchange once it spans this long on every rank
TARGET_WINDOW_S = 2.0  # the next exchange: this long at the pace seen (a window of >= MIN_WINDOW_S)
MAX_WINDOW_COMMITS = 1000  # ... but never further than this many commits away
PERSISTENT_WINDOWS = 3  # windows in a row above the ratio before a rank is reported
# Seconds between samples of the main thread (jittered +-50%). A window spans >= 1 s, so
# >= 20 samples, and a straggler shows in 3 windows in a row: the figure's noise (each
# stretch is attributed whole, by its last frame) stays far below --straggler-ratio.
SAMPLE_INTERVAL = 0.05
# A stretch blocked less than this is a GIL hand-over or a page fault, not a wait on
# peers: no frame walk for it (the walk is most of a sample's cost).
MIN_BLOCKED_S = 0.001
# Frames in these modules, on a main thread that uses no CPU, are waits on peers.
# Not torch.cuda (a GPU sync waits for this rank's own kernels: compute), nor
# torch.utils.data (a slow input pipeline is this rank's own slowness).
COLLECTIVE_MODULES = ("torch.distributed", "torch.nn.parallel", "torch.autograd", "elastic")


# -- the pure decision ----------------------------------------------------------------
def scores(compute_s: Sequence[float]) -> list[float]:
    """Each rank's compute time over the median of all ranks (1.0 when the median is 0)."""
    median = statistics.median(compute_s) if compute_s else 0.0
    if median <= 0:
        return [1.0 for _ in compute_s]
    return [c / median for c in compute_s]


class Persistence:
    """How many windows in a row each worker has been slower than ``ratio`` x median."""

    def __init__(self, ratio: float, windows: int = PERSISTENT_WINDOWS):
        self.ratio = ratio
        self.windows = windows
        self._runs: dict[str, int] = {}

    def reset(self) -> None:
        """A new ring: a new median, and ranks that mean other workers."""
        self._runs.clear()

    def update(self, workers: Sequence[str], window_scores: Sequence[float]) -> list[str]:
        """Take one window; return the workers that are persistent stragglers now,
        slowest first. A worker is reported once per run above the ratio: again only
        after it dropped below and came back."""
        runs = {w: self._runs.get(w, 0) + 1 for w, s in zip(workers, window_scores) if s > self.ratio}
        self._runs = runs
        persistent = [w for w in workers if runs.get(w) == self.windows]
        by_score = dict(zip(workers, window_scores))
        return sorted(persistent, key=lambda w: -by_score[w])

    def run_of(self, worker: str) -> int:
        return self._runs.get(worker, 0)


# -- measuring --------------------------------------------------------------------------
class WaitClock:
    """Daemon thread: seconds the main thread spent waiting on peers (sampled)."""

    def __init__(self, interval: float = SAMPLE_INTERVAL):
        self._interval = interval
        self._waiting = 0.0  # written by the thread only; a float read is atomic enough
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._cpu_clock = time.pthread_getcpuclockid(self._main)
        try:
            self._schedstat: Optional[int] = os.open(
                f"/proc/self/task/{threading.main_thread().native_id}/schedstat", os.O_RDONLY)
        except OSError:  # not Linux, or a kernel without scheduler statistics
            self._schedstat = None
        self._stdlib = stdlib_prefixes()
        self._thread = threading.Thread(target=self._run, name="elastic-wait-clock", daemon=True)

    def start(self) -> "WaitClock":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if not self._thread.is_alive():
            self._close()

    @property
    def waiting_s(self) -> float:
        return self._waiting

    def _run(self) -> None:
        jitter = random.Random()
        last_now, last_ran = time.monotonic(), self._ran()
        while not self._stop.wait(self._interval * jitter.uniform(0.5, 1.5)):
            now, ran = time.monotonic(), self._ran()
            blocked = max(0.0, (now - last_now) - (ran - last_ran))
            last_now, last_ran = now, ran
            if blocked >= MIN_BLOCKED_S and classify(main_thread_frames(self._main), self._stdlib, COLLECTIVE_MODULES)[0] == WAITING:
                self._waiting += blocked

    def _ran(self) -> float:
        """Seconds the main thread has been running or ready to run (waiting for a
        CPU): the rest of its life it was blocked. From the scheduler's statistics
        (run time + run-queue time), so that a thread starved of CPU on a loaded host
        is not taken for one waiting on its peers; else its CPU time alone."""
        if self._schedstat is not None:
            try:
                on_cpu, queued = os.pread(self._schedstat, 64, 0).split()[:2]
                return (int(on_cpu) + int(queued)) / 1e9
            except (OSError, ValueError):
                os.close(self._schedstat)
                self._schedstat = None
        return time.clock_gettime(self._cpu_clock)

    def _close(self) -> None:
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None


class StragglerWatch:
    """The worker's side: windows of commits, the exchange, the events."""

    def __init__(self, events, worker_id: str, ratio: float, clock: Optional[WaitClock] = None,
                 every: int = WINDOW_COMMITS, windows: int = PERSISTENT_WINDOWS,
                 min_window_s: float = MIN_WINDOW_S, target_window_s: float = TARGET_WINDOW_S,
                 now=time.monotonic, tell_agent=None):
        self._events = events
        # The typed message its agent acts on (contract/agent_channel.py); the event is for people.
        self._tell_agent = tell_agent if tell_agent is not None else (lambda message: None)
        self._worker = worker_id
        self._ring = None  # the facts of the ring it watches (rank, world, plan, backend), from begin_round
        self._clock = clock if clock is not None else WaitClock().start()
        self._every = every
        self._min_window_s = min_window_s
        self._target_window_s = target_window_s
        self._now = now
        # (commit, seconds per commit), alike on every rank -> the spacing of the ring's
        # switch points (switch_points.py); each exchange comes at one of those points.
        self._on_pace = None
        self._persistence = Persistence(ratio, windows)
        self._start: Optional[tuple[float, float, int]] = None  # (time, waiting_s, commit) at the window's start
        self._next = 0  # the round's commit of the next exchange
        self._round = None

    def close(self) -> None:
        self._clock.stop()

    def begin_round(self, ring, on_pace=None) -> None:
        """The training function is entered on ``ring`` (its rank, world, plan, round and
        backend, a ``RingView``): the next commit starts a window. ``on_pace(commit,
        seconds_per_commit)`` spaces that ring's switch points and says by how much."""
        self._ring, self._on_pace = ring, on_pace
        self._start = None
        if ring.round != self._round:
            self._round = ring.round
            self._persistence.reset()

    def on_commit(self, commits: int) -> None:
        """``commits`` counts the round's commits, equal on every rank."""
        now, waiting = self._now(), self._clock.waiting_s
        if self._start is None:
            self._start = (now, waiting, commits)  # the interval before the round's first commit is no step
            self._next = commits + self._every
            return
        if commits != self._next:
            return
        began, waited, first = self._start
        figures = self._gather(now - began, waiting - waited)
        # Short steps make short windows, and a few samples are a noisy estimate: the
        # window grows until it spans MIN_WINDOW_S on every rank. Decided on the
        # gathered figures, hence alike on every rank, like the next exchange.
        shortest = min(e for e, _ in figures)
        closes = shortest >= self._min_window_s
        per_commit = shortest / (commits - first)
        points = self._on_pace(commits, per_commit) if self._on_pace is not None else 1
        wanted_s = self._target_window_s if closes else self._min_window_s - shortest
        ahead = math.ceil(wanted_s / per_commit - 1e-6) if per_commit > 0 else self._every  # (rounding)
        ahead = min(MAX_WINDOW_COMMITS, max(self._every, ahead))
        self._next = commits + math.ceil(ahead / points) * points
        if closes:
            self._start = (now, waiting, commits)
            self._close_window(commits - first, figures)

    def _gather(self, elapsed: float, blocked: float) -> list[tuple[float, float]]:
        """One all_gather of (seconds, seconds waiting) since the window began, per rank."""
        rt = self._ring
        if rt.world_size == 1:
            return [(elapsed, blocked)]
        mine = torch.tensor([elapsed, blocked], dtype=torch.float64)
        if rt.capability.wire_device == "cuda":
            mine = mine.cuda()
        every = [torch.zeros_like(mine) for _ in range(rt.world_size)]
        dist.all_gather(every, mine)  # a broken ring raises here, like any collective
        return [(float(t[0]), float(t[1])) for t in every]

    def _close_window(self, steps: int, figures: list[tuple[float, float]]) -> None:
        rt = self._ring
        computes = [max(0.0, e - b) / steps for e, b in figures]
        step_s, compute_s = figures[rt.rank][0] / steps, computes[rt.rank]
        window_scores = scores(computes)
        rank = rt.rank
        worker = self._worker
        self._events.emit(
            "step_times", console=False, worker=worker, steps=steps,
            step_s=round(step_s, 5), compute_s=round(compute_s, 5), straggler_score=round(window_scores[rank], 3),
        )
        plan = rt.plan
        workers = list(plan.worker_ids()) if plan is not None else [worker]
        persistent = self._persistence.update(workers, window_scores)
        if worker not in persistent:
            return
        # Every rank has the same figures, hence the same list: the workers that all
        # straggler hosts would take with them are counted alike everywhere.
        hosts = {plan.slots[plan.rank_of(w)].member_id for w in persistent} if plan is not None else set()
        leaving = sum(1 for s in plan.slots if s.member_id in hosts) if plan is not None else 1
        host = plan.hosts[plan.slots[rank].member_id][0] if plan is not None else "local"
        ratio = window_scores[rank]
        log.warning(
            "round %s: straggler: host %s rank %d computes %.1fx the median (%.3fs vs %.3fs per step) "
            "for %d windows in a row", rt.round, host, rank, ratio, compute_s,
            statistics.median(computes), self._persistence.windows,
        )
        # The record's own host and rank name the straggler (it reports itself); the
        # line above is the one shown on the console.
        self._events.emit(
            "straggler_detected", console=False, worker=worker, ratio=round(ratio, 3),
            windows=self._persistence.windows, world_size=rt.world_size,
            remaining=remaining_after(rt.world_size, leaving),
        )
        self._tell_agent(Straggler(rt.round, rank, round(ratio, 3), remaining_after(rt.world_size, leaving)))
