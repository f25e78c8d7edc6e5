"""What every kind of state keeps about its commits, apart from the attributes the user named.

A state's public namespace is the user's: ``state.model``, ``state.epoch``, whatever
keywords the script gave. The runtime's records of the state (how many commits, the
round of the last one, whether it has synced, the durable step, the reset callbacks,
and each kind's own: the snapshot, the shard slots ...) live in one object, the state's
``_book``, so they never share a namespace with the user's names and a subclass that
defines ``__setattr__`` (the Horovod ``TorchState``) sees one private name, not thirty.

``State``/``TorchState`` (``elastic/state.py``), ``ShardedState``
(``elastic/sharded/state.py``) and the Horovod states implement the recovery loop's
protocol (``elastic/worker/committable.py``) side by side; this module is what they
share, and nothing here decides how a state commits or syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from elastic.checkpoint import CheckpointPolicy

from .contract.worker_config import WorkerConfig
from .worker.sync_plan import CommitId

UNREADABLE_ADVICE = "run again once the storage reads, or pass --checkpoint-allow-fresh-start to go without them"


@dataclass
class CommitBook:
    """The bookkeeping of a state's commits (one per state, in its ``_book``)."""

    value_names: tuple[str, ...]  # the plain values the user named, committed by value
    count: int = 0  # the job's commit count, carried in the state ("commits" in its trees)
    round: int = 0  # the round the last commit was made in
    synced: bool = False  # a sync has completed in this process
    durable_step: Optional[int] = None  # newest step on disk or being written
    resumed_from: Optional[int] = None  # the durable step this run started from (-1: none)
    reset_callbacks: list[Callable[[], None]] = field(default_factory=list)

    def next_commit(self, round_number: int) -> CommitId:
        """Count a commit made in ``round_number``."""
        self.count += 1
        self.round = round_number
        return CommitId(self.round, self.count)

    def take(self, commit: CommitId) -> None:
        """The state now is ``commit`` (a sync or a load brought it)."""
        self.round, self.count = commit.round, commit.count

    def add_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        self.reset_callbacks.extend(callbacks)

    def run_reset_callbacks(self) -> None:
        for callback in self.reset_callbacks:
            callback()


def put(state: Any, name: str, value: Any) -> None:
    """Set the user's attribute ``name`` as the runtime restores it. It bypasses a
    subclass's ``__setattr__``: the Horovod ``TorchState`` saves the state when a handled
    object is swapped, which a rollback or a sync putting a value back must not do."""
    object.__setattr__(state, name, value)


def values_of(state: Any, book: CommitBook) -> dict:
    """The plain values the user named, live (no copies)."""
    return {name: getattr(state, name) for name in book.value_names}


def checkpoint_policy(config: WorkerConfig) -> Optional[CheckpointPolicy]:
    """The durable-checkpoint policy that ``elastic-run --checkpoint-*`` asked for (None:
    no ``--checkpoint-dir``, as in a world of one)."""
    if not config.checkpoint_dir:
        return None
    return CheckpointPolicy(
        config.checkpoint_dir,
        every_commits=config.checkpoint_every,
        every_seconds=config.checkpoint_interval,
        keep=config.checkpoint_keep,
        skip_unreadable=config.checkpoint_allow_fresh_start,
        job_id=config.job_id,
    )
