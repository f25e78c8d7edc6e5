"""TorchState's objects with state_dict(): a scheduler, a GradScaler, EMA weights and a
user's class roll back with the commit, reach a joiner, survive a durable checkpoint, and
share the model's snapshot buffers; anything else is refused in one line."""

from __future__ import annotations


import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from elastic.checkpoint import CheckpointPolicy
from elastic.state import TorchState




class Counter:
    """A user's class: a tensor and an int behind state_dict()/load_state_dict()."""

    def __init__(self):
        self.total = torch.zeros(3, dtype=torch.float64)
        self.seen = 0

    def state_dict(self):
        return {"total": self.total, "seen": self.seen}

    def load_state_dict(self, saved):
        self.total, self.seen = saved["total"], saved["seen"]


def training_state(seed: int = 0) -> TorchState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    return TorchState(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, ema=ema,
                      counter=Counter(), step=0)


def train(state: TorchState, steps: int) -> None:
    for _ in range(steps):
        state.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = state.model(torch.ones(3, 4, dtype=torch.float64)).pow(2).sum()
        state.scaler.scale(loss).backward()
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.scheduler.step()
        state.ema.update_parameters(state.model)
        state.counter.total += 1.0
        state.counter.seen += 1
        state.step += 1


def observed(state: TorchState) -> dict:
    """Everything a rollback must bring back, as plain values and copies."""
    return {
        "last_epoch": state.scheduler.last_epoch,
        "last_lr": list(state.scheduler.get_last_lr()),
        "optimizer_lr": state.optimizer.param_groups[0]["lr"],
        "scale": state.scaler.get_scale(),
        "growth_tracker": state.scaler.state_dict()["_growth_tracker"],
        "n_averaged": int(state.ema.n_averaged),
        "ema": {k: v.clone() for k, v in state.ema.module.state_dict().items()},
        "model": {k: v.clone() for k, v in state.model.state_dict().items()},
        "counter": (state.counter.total.clone(), state.counter.seen),
        "step": state.step,
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
        elif key == "counter":
            assert torch.equal(a[key][0], b[key][0]) and a[key][1] == b[key][1]
        else:
            assert a[key] == b[key], key


def test_a_rollback_restores_the_scheduler_scaler_ema_and_a_users_object(ring):
    state = training_state()
    train(state, 3)
    state.commit()
    committed = observed(state)
    train(state, 3)  # the scheduler halves the LR, the scaler grows, the EMA averages on
    moved = observed(state)
    assert moved["last_epoch"] != committed["last_epoch"] and moved["scale"] != committed["scale"]
    assert moved["n_averaged"] != committed["n_averaged"] and moved["last_lr"] != committed["last_lr"]
    state.restore()
    assert_same(observed(state), committed)
    # Training on from the rollback repeats the same trajectory.
    train(state, 3)
    assert_same(observed(state), moved)


def test_a_restored_object_never_holds_the_snapshots_buffers(ring):
    state = training_state()
    train(state, 1)
    state.commit()
    own = state.counter.total
    train(state, 1)
    state.restore()
    assert state.counter.total is own  # overwritten in place, not handed a view
    buffers = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in state._book.snapshot.buffers()]
    assert not any(low <= own.data_ptr() < high for low, high in buffers)


def test_the_objects_tensors_share_the_models_reused_buffers(ring):
    state = training_state()
    train(state, 1)
    state.commit()
    first = [b.data_ptr() for b in state._book.snapshot.buffers()]
    tree = state._book.snapshot.tree()
    assert set(tree["objects"]) == {"scheduler", "scaler", "ema", "counter"}
    assert isinstance(tree["objects"]["scaler"]["scale"], float)
    train(state, 1)
    state.commit()
    # One float64 buffer for the model, the optimizer, the EMA and the counter, kept across commits.
    assert [b.data_ptr() for b in state._book.snapshot.buffers()] == first
    assert [b.dtype for b in state._book.snapshot.buffers()] == [torch.float64, torch.int64]


def test_a_joiner_receives_the_objects_with_the_commit(ring):
    holder = training_state(seed=0)
    train(holder, 4)
    holder.commit()
    joiner = training_state(seed=1)  # another initial state, as a new process would build
    # What State._receive does with the layout and the buffers a sync moves.
    joiner._book.snapshot.adopt_layout(holder._book.snapshot.layout())
    for mine, theirs in zip(joiner._book.snapshot.buffers(), holder._book.snapshot.buffers()):
        mine.copy_(theirs)
    joiner._load(joiner._book.snapshot.tree())
    assert_same(observed(joiner), observed(holder))
    train(joiner, 2)
    train(holder, 2)
    assert_same(observed(joiner), observed(holder))


def test_a_durable_checkpoint_holds_the_objects(ring, tmp_path):
    state = training_state(seed=0)
    state.enable_checkpoints(CheckpointPolicy(str(tmp_path), every_commits=1))
    train(state, 5)
    state.commit()
    state.flush_checkpoints(ring)
    resumed = training_state(seed=1)
    resumed.enable_checkpoints(CheckpointPolicy(str(tmp_path), every_commits=1))
    resumed.sync(ring)  # nobody holds a commit: the newest durable checkpoint is the commit
    assert_same(observed(resumed), observed(state))


class Bag:
    def state_dict(self):
        return {"names": {"a", "b"}}

    def load_state_dict(self, saved):
        pass


def test_a_value_without_state_dict_is_refused_at_construction_in_one_line():
    loader = torch.utils.data.DataLoader(list(range(4)))
    with pytest.raises(TypeError) as refused:
        TorchState(loader=loader)
    message = str(refused.value)
    assert "\n" not in message
    assert "'loader'" in message and "DataLoader" in message and "state_dict() and load_state_dict()" in message
    with pytest.raises(TypeError, match=r"keyword 'history' .*builtins.set at history/1"):
        TorchState(history=[1, {2}])


def test_a_state_dict_a_commit_cannot_hold_is_refused_at_the_first_commit(ring):
    state = TorchState(bag=Bag())
    with pytest.raises(TypeError) as refused:
        state.commit()
    message = str(refused.value)
    assert "\n" not in message and "'bag'" in message and "builtins.set at bag/names" in message
