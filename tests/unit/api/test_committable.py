"""Every state the recovery loop drives has what it needs (elastic/worker/committable.py)."""

from __future__ import annotations

import pytest
import torch

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


def _build():
    return torch.nn.Linear(2, 2)


@pytest.mark.parametrize("make, names", [
    (lambda: State(step=0, epoch=1), {"step", "epoch"}),
    (lambda: TorchState(model=_build(), epoch=0), {"model", "optimizer", "sampler", "epoch"}),
    (lambda: hvd_state.TorchState(_build(), batch=0), {"model", "optimizer", "batch"}),
    (lambda: ShardedState(model=_build, epoch=0), {"model", "optimizer", "scheduler", "sampler", "epoch"}),
])
def test_a_states_attributes_are_the_users_names_and_one_book(make, names):
    # The runtime's bookkeeping (commit count, snapshot, slots ...) lives in ``_book`` only
    # (elastic/commit_book.py): a user's name can never collide with it.
    assert set(vars(make())) == names | {"_book"}
