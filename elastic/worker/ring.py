"""One round's ring, as a value: what a worker trains on between two re-formations.

A ``Ring`` is built once, when its round has formed (``ring_entry.py``), and never
reused: the next round is a new ``Ring``. It holds the round's facts (its plan and the
plan before, this worker's rank and world, the backend's capability), the
process group's abort handle (``ring_abort.RingHandle``), its own commit gate (the
switch schedule, the commit count, rank 0's look at the joiners: ``commit_gate.py``)
and its publish check. Nothing resets it: leaving it (``leave``) is its end.

What it does, in the order a round lives:

    begin          the training function is entered on it (``recovery.py``)
    commit         a state's commit: one call, one verdict (``commit_gate.py``)
    broken_reason  why it is broken (aborted, or its backend's error), for the classifier
    abort          fail the peers' pending operations now (a fault only this worker saw)
    abort_device   abort its NCCL part before the device check (no kernel left to wait on)
    leave          tear its process group down; a failed ring's connections shut first
"""

from __future__ import annotations

from typing import Callable, Optional

from elastic.rendezvous import Etcd, JobKeys, RoundPlan

from ..contract.devices import Capability
from ..contract.events import EventLog
from ..contract.worker_config import WorkerConfig
from . import device_commit, publish_check, switch_points
from .commit_gate import CommitGate, Monitors, Verdict
from .ring_abort import RingHandle, broken_reason, leave_ring
from .ring_view import Position


class Ring:
    """One round's ring under elastic-run (see the module docstring); a ``RingView``."""

    def __init__(self, *, plan: RoundPlan, previous_plan: Optional[RoundPlan], position: Position,
                 capability: Capability, handle: RingHandle, monitors: Monitors,
                 config: WorkerConfig, events: EventLog, etcd: Optional[Etcd],
                 exchange: switch_points.Exchange = switch_points.ring_exchange):
        self.plan = plan
        self.previous_plan = previous_plan
        self.round = plan.round
        self.position = position
        self.rank, self.world_size = position.rank, position.world_size
        self.local_rank, self.local_world_size = position.local_rank, position.local_world_size
        self.capability = capability
        self.handle = handle
        self.config = config
        self.events = events
        self._etcd = etcd
        self._monitors = monitors
        self._gate = CommitGate(monitors, plan, position.rank, handle,
                                drains=device_commit.drains_at_commit(capability), exchange=exchange)

    @property
    def backend(self) -> str:
        return self.capability.backend

    @property
    def progress_board(self):
        return self._monitors.board

    # -- the training function on this ring ----------------------------------------
    def begin(self) -> None:
        """The training function is entered on this ring."""
        self._gate.begin(self)

    def commit(self, capture: Callable[["Ring"], Optional[int]]) -> Verdict:
        """A state's commit, the one call it makes: left behind?, ring check, ``capture(self)``,
        step log, pace exchange and the switch decision, in that order (commit_gate.py)."""
        verdict = self._gate.at_commit(capture, self)
        if verdict is not Verdict.CONTINUE:
            device_commit.before_planned_leave(self)  # overlapped commits: the step's kernels end first
        return verdict

    def ring_change_ready(self) -> bool:
        return self._gate.ring_change_ready()

    def publish_check(self) -> Callable[[], bool]:
        """A check for the checkpoint writer, asked right before it publishes a write of
        this round: has this worker been in every round since (read afresh from etcd)? A
        host cut off and healed must never publish what it wrote before the job moved on
        without it (publish_check.py says why being in the newest plan is not enough)."""
        return publish_check.make(self._etcd, JobKeys(self.config.job_id), self.config.worker_id, self.round)

    def follow_sampler(self, sampler) -> None:
        self._monitors.steps.sampler = sampler  # its counts go with the step records (step_log.py)

    # -- its failure and its end ----------------------------------------------------
    def broken_reason(self) -> Optional[str]:
        """Why this ring is broken (aborted, or its backend's error: NCCL's), or None."""
        return broken_reason(self.handle)

    def abort(self) -> None:
        """Fail the peers' pending operations at once (a fault only this worker saw)."""
        self.handle.abort()

    def abort_device(self) -> None:
        """After a failure, before the device check: abort the ring's NCCL part (a no-op if
        the control thread did), so that none of its kernels is left for the check to wait
        on (device_health.py). The ring is left later, by ``leave``."""
        if self.handle.backend_abort:
            self.handle.abort()
            self.handle.wait_aborted()  # bounded: past its deadline the worker exits broken

    def leave(self, failed: bool) -> None:
        """The end of this ring: its last steps logged, its process group torn down. An NCCL
        ring is aborted, never destroyed, at a planned switch too: ``destroy_process_group``
        finalizes its communicators, which waits for pending work and can block on a dead
        peer (ring_abort.leave_ring). Call outside any ``except`` block: a live traceback
        keeps the old group's sockets open."""
        self._monitors.steps.close()  # the old ring's last steps end here: the gap starts
        leave_ring(self.handle, failed=failed, round_number=self.round)
