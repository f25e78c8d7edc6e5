"""What a commit asks of its ring: one call, one verdict (go on, switch, stop).

``state.commit()`` makes one call, ``ring.commit(capture)`` (``ring.py``), and gets a
``Verdict``. The ring's gate runs the steps in this order, and a reader finds each one here:

1. **left behind?**: a worker the job left behind (its host paused or cut off past the TTL)
   makes no commit in a round that is over (``left_behind.py``);
2. **ring check**: a step made on a broken ring is no commit (``ring_abort.check_ring``);
   both raise before the snapshot is overwritten, so the previous commit stays intact;
3. **capture**: the state copies itself (``capture(ring)``, the state's own code: the one
   call back up);
4. **step log**: the timeline's span of commits and the hang watchdog's progress mark;
5. **pace exchange**: every few commits one small ``all_gather`` of step times
   (``stragglers.py``); its pace spaces the switch points (``switch_points.py``), so it
   runs before the switch decision, at the same commit on every rank;
6. **switch decision**: at a switch point every rank takes the word rank 0 posted at
   the point before (one tiny broadcast over the ring, ``switch_points.ring_exchange``)
   and the whole ring acts on it there; then rank 0 decides (``decide_switch``, a pure
   function) and posts its word for the next point. Posted, not awaited: a commit never
   waits for its peers' commits. The decision never travels through the round's store,
   which more than the ring can reach: nothing a stranger writes there can switch, stop
   or break the ring.

Only the ring check and the capture cost anything per commit in a steady round; the
exchange and the switch point's broadcast come every few commits. A gate is built with its ring and
dies with it: its switch schedule, commit count and look at the joiners are that ring's.
What outlives a ring (the step log, the control channel, the watchdog's marks, the
straggler watch) is the session's ``Monitors``, handed to each ring's gate.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional

from elastic.rendezvous import STOPPING, RoundPlan

from ..contract.errors import HostsUpdatedInterrupt, JobStopping
from . import device_watch, switch_points
from .joiners import JoinerWatch
from .ring_abort import RingHandle, check_ring
from .switch_points import SwitchPoints


class Verdict(enum.Enum):
    """What the whole ring does after this commit."""

    CONTINUE = "continue"
    SWITCH = "switch"  # a newer round (a join, a graceful leave): HostsUpdatedInterrupt
    STOP = "stop"  # the job was told to stop: JobStopping


@dataclass(frozen=True)
class SwitchAt:
    """Rank 0's choice: the ring acts as ``verdict`` at its commit ``commit``."""

    commit: int
    verdict: Verdict


@dataclass
class Monitors:
    """What watches the worker across its rings (the session's): each ring's gate uses them."""

    steps: Any  # step_log.StepLog: the timeline's spans of commits
    control: Any = None  # the job's control channel (plan, status)
    left_behind: Any = None  # left_behind.LeftBehindCheck
    progress: Any = None  # contract/progress.Progress: the hang watchdog's marks
    stragglers: Any = None  # stragglers.StragglerWatch: the pace exchange
    device_watch: Any = None  # GPU workers: the step's device work (device_watch.py), from commit to commit

    @property
    def board(self):
        """The worker's progress board (contract/progress.py), None without a watchdog."""
        return self.progress.board if self.progress is not None else None

    def close(self) -> None:
        if self.device_watch is not None:
            self.device_watch.close()


def decide_switch(*, stopping: bool, pending: bool, joiners_ready: Callable[[], bool],
                  commits: int) -> Optional[SwitchAt]:
    """Rank 0's choice at its switch point ``commits``: stop when the job stops; switch to
    a pending round once its joiners have arrived (``joiners_ready`` is asked only then,
    it reads the store); else nothing. The whole ring takes it at the next point (the
    broadcast posted here), and acts there."""
    if stopping:
        return SwitchAt(commits, Verdict.STOP)
    if pending and joiners_ready():
        return SwitchAt(commits, Verdict.SWITCH)
    return None


class CommitGate:
    """One ring's side of a commit: built with the ring, it holds that ring's switch schedule."""

    def __init__(self, monitors: Monitors, plan: Optional[RoundPlan], rank: int,
                 handle: Optional[RingHandle] = None, *, drains: bool = False,
                 exchange: switch_points.Exchange = switch_points.ring_exchange):
        self._monitors = monitors
        self._plan = plan
        self._rank = rank
        self._handle = handle  # the ring's, for the ring check
        self._drains = drains  # sync the device before the ring check (NCCL: device_commit.py)
        self._exchange = exchange  # rank 0's word to the ring at a switch point (a broadcast)
        self._posted: Optional[Callable[[], list]] = None  # the last point's word, taken at the next
        self.points = SwitchPoints()  # the commits where the ring may act
        self.commits = 0  # commits in this ring
        self._joiners = JoinerWatch()  # rank 0's look at a pending round's joiners
        self.switch: Optional[SwitchAt] = None

    def begin(self, ring) -> None:
        """The training function is entered on this ring (``ring``: its facts, for the pace exchange)."""
        monitors = self._monitors
        monitors.steps.begin()
        if monitors.left_behind is not None:
            monitors.left_behind.reset()  # in step with the ring: a long re-formation is no gap
        if monitors.progress is not None:
            monitors.progress.mark(interval=False)  # the re-formation is no step interval
        if monitors.stragglers is not None:
            monitors.stragglers.begin_round(ring, on_pace=self.points.agree)

    # -- the commit ------------------------------------------------------------
    def at_commit(self, capture: Callable[[Any], Optional[int]], ring) -> Verdict:
        """Run a commit's steps in order (module docstring); ``capture(ring)`` returns the
        job's commit count (for the timeline) and raises nothing the ring must know of."""
        monitors = self._monitors
        if monitors.left_behind is not None:  # 1. left behind?
            monitors.left_behind.check(ring.round, monitors.control.plan)
        if monitors.progress is not None:  # GPU workers: the step's device work, before the ring check's sync
            monitors.device_watch = device_watch.commit_mark(monitors.device_watch, monitors.progress.board)
        check_ring(self._handle, device_sync=self._drains)  # 2. broken ring?
        number = capture(ring)  # 3. the state's copy
        self.commits += 1  # 4. step log
        monitors.steps.commit(number, ring.world_size)
        if monitors.progress is not None:
            # The first commit of a round follows DDP's broadcast and warm-up: not a step.
            monitors.progress.mark(interval=self.commits > 1, commit=True)
        if monitors.stragglers is not None:  # 5. pace exchange, every few commits
            monitors.stragglers.on_commit(self.commits)
        return self.verdict()  # 6. switch decision

    def verdict(self) -> Verdict:
        """Whether the ring acts at its commit ``self.commits``. At a switch point every rank
        takes the word rank 0 posted at the point before (a collective: the same points on
        every rank), so every worker does what rank 0 decided, never what its own copy of
        the status says, and all do it at this same commit."""
        commits = self.commits
        if self.switch is None and self.points.is_point(commits):
            if self._posted is not None:
                action = switch_points.read_decision(self._posted(), commits)
                self._posted = None
                if action is not None:
                    self.switch = SwitchAt(commits, Verdict(action))
            if self.switch is None:
                decided = None
                if self._rank == 0:
                    choice = self._decide(commits)
                    decided = (choice.commit, choice.verdict.value) if choice is not None else None
                self._posted = self._exchange(switch_points.decision_words(decided))
        if self.switch is not None and commits >= self.switch.commit:
            return self.switch.verdict
        return Verdict.CONTINUE

    def _decide(self, commits: int) -> Optional[SwitchAt]:
        control = self._monitors.control
        newest = control.plan
        return decide_switch(stopping=control.status.state == STOPPING,
                             pending=newest is not None and newest.round > self._plan.round,
                             joiners_ready=lambda: self._joiners.ready(self._plan, newest), commits=commits)

    def ring_change_ready(self) -> bool:
        """Rank 0's view between commits (``hvd.elastic``'s ``check_host_updates``): would
        the ring switch to a newer round at a commit now (its joiners have arrived)?"""
        control = self._monitors.control
        if control.status.state == STOPPING:
            return False
        newest = control.plan
        return newest is not None and newest.round > self._plan.round and self._joiners.ready(self._plan, newest)


def act_on(verdict: Verdict, commits: int) -> None:
    """Raise what the user's loop sees of a verdict (recovery.py catches both)."""
    if verdict is Verdict.STOP:
        raise JobStopping(f"job stops after commit {commits}")
    if verdict is Verdict.SWITCH:
        raise HostsUpdatedInterrupt(f"ring changes after commit {commits}")
