"""``hvd.elastic``: Horovod's elastic API on this runtime's in-process recovery.

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

``run`` is ``elastic.run``: the function is re-entered on a new ring after every
re-formation. A broken ring (``HorovodInternalError``, a dead peer) rolls back to the
last commit; a membership change at a commit or at ``check_host_updates()`` rolls back
nothing; then the new ring syncs the newest commit, every ``ElasticSampler`` of the
state is partitioned among it, and the reset callbacks run (after the sync, unlike
Horovod: its issue 2844). Differences from Horovod are listed in ``state.py`` and
``sampler.py`` and in docs/horovod.md.

It may import ``elastic.horovod``'s modules (not the package itself: that would be
an import cycle), the ``elastic`` API and the worker room.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, TypeVar

from ...contract.errors import HostsUpdatedInterrupt
from ...worker import recovery
from ..basics import follows_rounds
from ..common import HorovodInternalError
from .sampler import ElasticSampler
from .state import ObjectState, TorchState

State = ObjectState

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "run"]

T = TypeVar("T")


def run(func: Callable[..., T]) -> Callable[..., Optional[T]]:
    """Horovod's ``hvd.elastic.run``: call ``func(state, ...)`` and re-enter it after every
    re-formation. Nothing happens at decoration time (scripts decorate before
    ``hvd.init()``); the runtime is looked up at the call."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        follows_rounds(True)  # from here on its ring re-forms in-process
        return recovery.run(func)(state, *args, **kwargs)

    return wrapper
