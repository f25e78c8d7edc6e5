"""What the recovery loop needs of a state: one protocol, whatever state the script uses.

``recovery.run`` drives ``elastic.State``/``TorchState``, ``elastic.sharded.ShardedState``
and the Horovod states (``elastic/horovod/elastic/state.py``) through these members
only: the identity of the commit it holds, a commit, a rollback, a sync to the ring's
newest commit, the reset callbacks, and the final durable write. A new kind of state
implements them; recovery reads nothing else (no private attribute of a state). The
ring is handed in (a ``RingView``: ``ring_view.py``); only ``commit()``, which the
user's loop calls, asks the process for it.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from .ring_view import RingView
from .sync_plan import CommitId, SyncPlan


@runtime_checkable
class Committable(Protocol):
    @property
    def commit_id(self) -> Optional[CommitId]:
        """(round, count) of the commit this worker holds, or None."""

    def commit(self) -> None:
        """Copy the state (its one call to the ring: ``ring.commit(capture)``); raise
        HostsUpdatedInterrupt or JobStopping when the ring acts at this commit."""

    def restore(self) -> None:
        """Roll the live state back to the last commit (after a failure)."""

    def sync(self, ring: RingView) -> SyncPlan:
        """Make every worker of ``ring`` (a new ring) hold its newest commit."""

    def on_reset(self, ring: RingView) -> None:
        """The ring changed to ``ring``: the user's reset callbacks run."""

    def flush_checkpoints(self, ring: RingView, final: bool = False) -> None:
        """Wait for the durable write in flight; with ``final``, make the last commit durable."""
