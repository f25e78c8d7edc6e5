"""Every state the recovery loop drives has what it needs (elastic/worker/committable.py)."""

from __future__ import annotations

import pytest

from elastic.horovod.elastic import state as hvd_state
from elastic.sharded.state import ShardedState
from elastic.state import State, TorchState
from elastic.worker.committable import Committable

MEMBERS = ("commit_id", "commit", "restore", "sync", "on_reset", "flush_checkpoints")


def test_the_plain_states_are_committable():
    assert isinstance(State(step=0), Committable)
    assert isinstance(TorchState(), Committable)


@pytest.mark.parametrize("cls", [ShardedState, hvd_state.ObjectState, hvd_state.TorchState])
def test_the_sharded_and_horovod_states_have_every_member(cls):
    assert [name for name in MEMBERS if not hasattr(cls, name)] == []
