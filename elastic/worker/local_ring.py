"""The world of one: a script run without elastic-run keeps working, alone, on a ring of itself.

``elastic.init()`` without an agent (no ``ELASTIC_WORKER_ID``) starts a session whose
ring is a ``LocalRing``: rank 0 of 1, a gloo process group on an in-memory store, no
etcd, no round to leave or join. A commit copies the state and goes on; nothing can
switch or stop it, and a failure is never re-formed (--max-resets 0: the budget of a
world of one), so the training function's error reaches the user as it would without
this library. It is a ``RingView`` like the ``Ring`` of a job, so no state asks which
of the two it has.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist

from ..contract.devices import capability
from ..contract.events import EventLog
from ..contract.worker_config import WorkerConfig
from .commit_gate import Verdict
from .ring_abort import leave_ring
from .ring_view import ALONE, Position
from .step_log import StepLog

# What a world of one is configured with: no durable checkpoints, no re-formation.
LOCAL_CONFIG = WorkerConfig(job_id="local", endpoints="", worker_id="local", member_id="local", host_id="local",
                            round=0, max_resets=0)


class LocalRing:
    """Rank 0 of a world of one (a ``RingView``)."""

    round = 0
    plan = None
    previous_plan = None
    handle = None  # nothing to abort: no peer waits on this process
    progress_board = None
    position: Position = ALONE

    def __init__(self, events: EventLog, steps: StepLog):
        self.rank, self.world_size = ALONE.rank, ALONE.world_size
        self.local_rank, self.local_world_size = ALONE.local_rank, ALONE.local_world_size
        self.capability = capability("gloo")
        self.config = LOCAL_CONFIG
        self.events = events
        self._steps = steps

    @property
    def backend(self) -> str:
        return self.capability.backend

    @staticmethod
    def form() -> None:
        """The process group of one, so that scripts' collectives run unchanged."""
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def begin(self) -> None:
        self._steps.begin()

    def commit(self, capture: Callable[["LocalRing"], Optional[int]]) -> Verdict:
        """Nothing to check or to agree on: the state's copy, and the step record."""
        self._steps.commit(capture(self), self.world_size)
        return Verdict.CONTINUE

    def publish_check(self) -> None:
        return None  # no job that could have moved on without this process

    def ring_change_ready(self) -> bool:
        return False

    def follow_sampler(self, sampler) -> None:
        self._steps.sampler = sampler

    def broken_reason(self) -> Optional[str]:
        return None

    def abort(self) -> None:
        pass

    def abort_device(self) -> None:
        pass

    def leave(self, failed: bool) -> None:
        self._steps.close()
        leave_ring(None, failed=failed, round_number=self.round)
