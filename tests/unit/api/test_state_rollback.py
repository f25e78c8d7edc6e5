"""TorchState's rollback copies the optimizer's state into its own tensors (no allocation
on the recovery path) and never lets it alias the snapshot."""

from __future__ import annotations

import torch

from elastic.checkpoint import Snapshot
from elastic.checkpoint import copy_into


def adam_after_a_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_rollback_overwrites_the_optimizers_own_tensors():
    model, optimizer = adam_after_a_step()
    snapshot = Snapshot()
    snapshot.capture(optimizer.state_dict())
    own = {id(p): state["exp_avg"] for p, state in optimizer.state.items()}
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # moves on from the commit
    saved = snapshot.tree()
    optimizer.load_state_dict(copy_into(saved, optimizer.state_dict()))
    for index, (param, state) in enumerate(optimizer.state.items()):
        assert state["exp_avg"] is own[id(param)]  # the same tensor, overwritten
        assert torch.equal(state["exp_avg"], saved["state"][index]["exp_avg"])
        assert torch.equal(state["step"], saved["state"][index]["step"])
    buffers = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in snapshot.buffers()]
    for state in optimizer.state.values():  # nothing points into the snapshot
        for value in state.values():
            assert not any(low <= value.data_ptr() < high for low, high in buffers)


def test_a_joiner_without_optimizer_state_gets_fresh_copies():
    _, trained = adam_after_a_step()
    snapshot = Snapshot()
    snapshot.capture(trained.state_dict())
    fresh = torch.optim.Adam(torch.nn.Linear(4, 3).parameters(), lr=0.1)
    fresh.load_state_dict(copy_into(snapshot.tree(), fresh.state_dict()))
    views = {v.data_ptr() for state in snapshot.tree()["state"].values() for v in state.values()}
    for index, state in enumerate(fresh.state.values()):
        for key, value in state.items():
            assert torch.equal(value, trained.state_dict()["state"][index][key])
            assert value.data_ptr() not in views
