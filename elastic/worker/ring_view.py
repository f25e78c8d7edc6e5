"""What a state may ask of the ring it commits and syncs on: declared once, for every kind of ring.

The API layer (``elastic.State``, ``ShardedState``, the Horovod states and queries) meets
the worker room here and nowhere else. Three kinds of ring satisfy ``RingView``:

    Ring        one round of a job under elastic-run (``ring.py``), built when the round
                forms and never reused
    LocalRing   the world of one: a script run without elastic-run (``local_ring.py``)
    FakeRing    a test's (``tests/fakes/ring.py``)

so a state never asks whether it runs under elastic-run, and never probes what it got.
A state is handed its ring by the recovery loop (``sync(ring)``, ``on_reset(ring)``,
``flush_checkpoints(ring, final)``); only ``State.commit()``, called from the user's
loop, asks the process for its current ring (``lifecycle.ring()``).

``Position`` is where this worker stands in a round: a ring's, and before a joiner's
ring exists (it enters it at its first sync), the rank its plan gives it, which
``elastic.rank()`` and ``hvd.rank()`` answer with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, runtime_checkable

from elastic.rendezvous import RoundPlan

from ..contract.devices import Capability
from ..contract.events import EventLog
from ..contract.worker_config import WorkerConfig
from .commit_gate import Verdict
from .ring_abort import RingHandle


@dataclass(frozen=True)
class Position:
    """This worker's place in a round: its rank, the world, and its host's share of it."""

    plan: Optional[RoundPlan]  # None: the world of one
    rank: int
    world_size: int
    local_rank: int  # the device slot its agent gave it, for the process's life
    local_world_size: int

    @classmethod
    def in_plan(cls, plan: RoundPlan, worker_id: str, local_rank: int) -> "Position":
        rank = plan.rank_of(worker_id)
        return cls(plan, rank, plan.world_size, local_rank, len(plan.local_ranks(plan.slots[rank].member_id)))


ALONE = Position(None, 0, 1, 0, 1)


@runtime_checkable
class RingView(Protocol):
    """What a state, a sampler or a Horovod query may ask of a ring."""

    round: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    plan: Optional[RoundPlan]  # None: the world of one
    previous_plan: Optional[RoundPlan]  # the ring before: bounds the commits a sync may claim
    capability: Capability  # the backend, and where its tensors travel
    config: WorkerConfig  # what elastic-run asked for (checkpoints, replicas, timeouts)
    events: EventLog
    handle: Optional[RingHandle]  # the process group's abort handle (an overlapped copy asks it)

    @property
    def backend(self) -> str:
        """The backend string of the ring's process group."""

    @property
    def progress_board(self):
        """The worker's progress board (contract/progress.py), None without a watchdog."""

    def commit(self, capture: Callable[["RingView"], Optional[int]]) -> Verdict:
        """A state's commit (``commit_gate.py``): ``capture(ring)`` copies the state."""

    def publish_check(self) -> Optional[Callable[[], bool]]:
        """For rank 0's checkpoint writer: may a write of this round still be published?"""

    def ring_change_ready(self) -> bool:
        """Rank 0, between commits: would the ring switch to a newer round now?"""

    def follow_sampler(self, sampler) -> None:
        """Report ``sampler``'s counts with the step records (``step_log.py``)."""
