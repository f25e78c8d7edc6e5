"""A TorchState commit finds its live tensors once per layout (elastic/live_tree.py), and
never commits a stale one: each way a model or optimizer can swap a tensor is caught."""

from __future__ import annotations


import pytest
import torch

from elastic.live_tree import LiveTree, live_tree
from elastic.state import TorchState


pytestmark = pytest.mark.usefixtures("ring")  # tests/unit/api/conftest.py


def _job(momentum=0.9):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    return model, optimizer


def _step(model, optimizer):
    optimizer.zero_grad()
    model(torch.randn(16, 4)).pow(2).mean().backward()
    optimizer.step()


def _assert_committed_equals_live(state):
    """The commit holds what ``state_dict()`` would have given at the commit."""
    committed = state._book.snapshot.tree()
    for key, value in state.model.state_dict().items():
        assert torch.equal(committed["model"][key], value), key
    live = state.optimizer.state_dict()
    assert committed["optimizer"]["param_groups"] == live["param_groups"]
    for index, entries in live["state"].items():
        for name, value in entries.items():
            assert torch.equal(committed["optimizer"]["state"][index][name], value), (index, name)


def test_a_steady_layout_is_found_once_and_each_commit_copies_the_current_values():
    model, optimizer = _job()
    state = TorchState(model=model, optimizer=optimizer)
    _step(model, optimizer)
    state.commit()
    found = state._book.live
    for _ in range(3):
        _step(model, optimizer)
        state.commit()
        assert state._book.live is found
        _assert_committed_equals_live(state)


@pytest.mark.parametrize("change", ["optimizer state appears", "parameter replaced", "data swapped",
                                    "buffer replaced", "submodule replaced", "new optimizer"])
def test_each_way_to_swap_a_tensor_finds_the_tensors_anew(change):
    model, optimizer = _job()
    state = TorchState(model=model, optimizer=optimizer)
    if change != "optimizer state appears":
        _step(model, optimizer)
    state.commit()
    found = state._book.live
    if change == "optimizer state appears":
        _step(model, optimizer)  # the first step creates the momentum buffers
    elif change == "parameter replaced":
        model[0].weight = torch.nn.Parameter(torch.full((8, 4), 7.0))
    elif change == "data swapped":
        model[2].bias.data = torch.full((2,), 5.0)
    elif change == "buffer replaced":
        model[1].running_mean = torch.full((8,), 3.0)
    elif change == "submodule replaced":
        model[2] = torch.nn.Linear(8, 2)
    elif change == "new optimizer":
        state.optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        _step(model, state.optimizer)
    state.commit()
    assert state._book.live is not found
    _assert_committed_equals_live(state)


def test_a_learning_rate_a_scheduler_moved_is_committed_and_restored():
    model, optimizer = _job()
    state = TorchState(model=model, optimizer=optimizer)
    _step(model, optimizer)
    state.commit()
    optimizer.param_groups[0]["lr"] = 0.05
    state.commit()
    optimizer.param_groups[0]["lr"] = 1.0
    _step(model, optimizer)
    state.restore()
    assert optimizer.param_groups[0]["lr"] == 0.05
    assert optimizer.state_dict()["param_groups"][0]["params"] == list(range(6))


def test_a_rollback_restores_the_values_of_the_cached_tensors_in_place():
    model, optimizer = _job()
    state = TorchState(model=model, optimizer=optimizer)
    _step(model, optimizer)
    state.commit()
    params = [p.detach().clone() for p in model.parameters()]
    momenta = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    identities = [id(p) for p in model.parameters()]
    _step(model, optimizer)
    state.restore()
    assert [id(p) for p in model.parameters()] == identities
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), params))
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momenta))


def test_hooks_and_plain_optimizer_state_are_read_at_every_commit():
    model, optimizer = _job()
    model[0]._register_state_dict_hook(lambda module, sd, prefix, local: None)
    _step(model, optimizer)
    optimizer.state[next(iter(model.parameters()))]["counter"] = 3  # a plain entry: no tensor to copy
    live = LiveTree(model, optimizer)
    assert live.model_flat is None and live.state_flat is None
    assert live_tree(live, model, optimizer) is live  # nothing cached, nothing to go stale
