"""What a commit asks of the runtime: one call, one verdict (go on, switch, stop).

``state.commit()`` makes one call, ``Runtime.commit(capture)``, and gets a ``Verdict``.
The gate runs the steps in this order, and a reader finds each one here:

1. **left behind?**: a worker the job left behind (its host paused or cut off past the TTL)
   makes no commit in a round that is over (``left_behind.py``);
2. **ring check**: a step made on a broken ring is no commit (``ring_abort.check_ring``);
   both raise before the snapshot is overwritten, so the previous commit stays intact;
3. **capture**: the state copies itself (``capture(ticket)``, the state's own code);
4. **step log**: the timeline's span of commits and the hang watchdog's progress mark;
5. **pace exchange**: every few commits one small ``all_gather`` of step times
   (``stragglers.py``); its pace spaces the switch points (``switch_points.py``), so it
   runs before the switch decision, at the same commit on every rank;
6. **switch decision**: rank 0 decides (``decide_switch``, a pure function) and posts
   ``switch_at`` in the round's store; the others read it at switch points.

Only the ring check and the capture cost anything per commit in a steady round; the
exchange and the store's look come every few commits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional

from elastic.rendezvous import STOPPING

from ..contract.errors import HostsUpdatedInterrupt, JobStopping
from . import device_watch, switch_points
from .joiners import JoinerWatch
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


@dataclass(frozen=True)
class Ticket:
    """What a state's capture needs of the runtime at its commit."""

    round: int
    rank: int
    world_size: int
    publish_check: Callable[[], Optional[Callable[[], bool]]]  # rank 0's checkpoint writer asks it


def decide_switch(*, stopping: bool, pending: bool, joiners_ready: Callable[[], bool], commits: int,
                  points: SwitchPoints) -> Optional[SwitchAt]:
    """Rank 0's choice at its commit ``commits``: stop when the job stops; switch to a
    pending round once its joiners have arrived (``joiners_ready`` is asked only then,
    it reads the store); else nothing. The ring acts at the next switch point: every
    rank is within one step of rank 0 (each step has a collective with it), so all read
    the choice before their commit of that number."""
    if stopping:
        return SwitchAt(points.next_point(commits), Verdict.STOP)
    if pending and joiners_ready():
        return SwitchAt(points.next_point(commits), Verdict.SWITCH)
    return None


def commit_alone(capture: Callable[[Ticket], object], round_number: int = 0) -> Verdict:
    """A commit in a world of one without elastic-run: nothing to check or to agree on."""
    capture(Ticket(round_number, 0, 1, lambda: None))
    return Verdict.CONTINUE


class CommitGate:
    """The runtime's side of a commit; ``Runtime`` hands it the parts it runs."""

    def __init__(self, steps, check_ring: Callable[[], None]):
        self.steps = steps  # step_log.StepLog
        self._check_ring = check_ring
        self.control = None  # the job's control channel (plan, status)
        self.left_behind = None  # left_behind.LeftBehindCheck
        self.progress = None  # contract/progress.Progress: the hang watchdog's marks
        self.stragglers = None  # stragglers.StragglerWatch: the pace exchange
        self._device_watch = None  # GPU workers: the step's device work (device_watch.py)
        self.points = SwitchPoints()  # the commits where the ring may act
        self.commits = 0  # commits in the current round
        self._store = None  # the round's PrefixStore, while in a ring
        self._joiners = JoinerWatch()  # rank 0's look at a pending round's joiners
        self.switch: Optional[SwitchAt] = None

    # -- the round -------------------------------------------------------------
    def enter(self, store) -> None:
        """A ring was formed: its store, a fresh schedule of switch points."""
        self._store, self.switch, self.points = store, None, SwitchPoints()

    def leave(self) -> None:
        self._store, self.switch = None, None
        self._joiners.forget()

    def begin(self) -> None:
        """The training function is (re-)entered on the current ring."""
        self.commits = 0
        self.steps.begin()
        if self.left_behind is not None:
            self.left_behind.reset()  # in step with the ring: a long re-formation is no gap
        if self.progress is not None:
            self.progress.mark(interval=False)  # the re-formation is no step interval
        if self.stragglers is not None:
            self.stragglers.begin_round()

    # -- the commit ------------------------------------------------------------
    def at_commit(self, capture: Callable[[Ticket], Optional[int]], ticket: Ticket, plan) -> Verdict:
        """Run a commit's steps in order (module docstring); ``capture`` returns the job's
        commit count (for the timeline) and raises nothing the ring must know of."""
        if self.left_behind is not None:  # 1. left behind?
            self.left_behind.check(ticket.round, self.control.plan)
        if self.progress is not None:  # GPU workers: the step's device work, before the ring check's sync
            self._device_watch = device_watch.commit_mark(self._device_watch, self.progress.board)
        self._check_ring()  # 2. broken ring?
        number = capture(ticket)  # 3. the state's copy
        self.commits += 1  # 4. step log
        self.steps.commit(number, ticket.world_size)
        if self.progress is not None:
            # The first commit of a round follows DDP's broadcast and warm-up: not a step.
            self.progress.mark(interval=self.commits > 1, commit=True)
        if self.stragglers is not None:  # 5. pace exchange, every few commits
            self.stragglers.on_commit(self.commits)
        return self.verdict(ticket.rank, ticket.round, plan)  # 6. switch decision

    def verdict(self, rank: int, round_number: int, plan) -> Verdict:
        """Whether the ring acts at this round's commit ``self.commits``."""
        commits = self.commits
        if self._store is None:
            return Verdict.CONTINUE
        if self.switch is None:
            if rank == 0:
                newest = self.control.plan
                choice = decide_switch(
                    stopping=self.control.status.state == STOPPING,
                    pending=newest is not None and newest.round > round_number,
                    joiners_ready=lambda: self._joiners.ready(plan, newest), commits=commits, points=self.points)
                if choice is not None:
                    # The verdict travels with the commit number: every worker does what
                    # rank 0 decided, never what its own copy of the status says.
                    self.switch = choice
                    self._store.set("switch_at", f"{choice.commit} {choice.verdict.value}")
            elif self.points.is_point(commits) and self._store.check(["switch_at"]):
                at, action = switch_points.parse_switch_at(self._store.get("switch_at"), commits)
                # The store is not the job: act once our own view of etcd shows why.
                switch_points.confirm(action, lambda: switch_points.has_grounds(action, self.control, round_number))
                self.switch = SwitchAt(at, Verdict(action))
        if self.switch is not None and commits >= self.switch.commit:
            return self.switch.verdict
        return Verdict.CONTINUE

    def ring_change_ready(self, rank_plan, round_number: int) -> bool:
        """Rank 0's view between commits (``hvd.elastic``'s ``check_host_updates``): would
        the ring switch to a newer round at a commit now (its joiners have arrived)?"""
        if self._store is None or self.control.status.state == STOPPING:
            return False
        newest = self.control.plan
        return newest is not None and newest.round > round_number and self._joiners.ready(rank_plan, newest)

    def close(self) -> None:
        if self._device_watch is not None:
            self._device_watch.close()


def act_on(verdict: Verdict, commits: int) -> None:
    """Raise what the user's loop sees of a verdict (recovery.py catches both)."""
    if verdict is Verdict.STOP:
        raise JobStopping(f"job stops after commit {commits}")
    if verdict is Verdict.SWITCH:
        raise HostsUpdatedInterrupt(f"ring changes after commit {commits}")
