"""ShardedState(scheduler=...) takes a factory of the optimizer; a scheduler object, or a
factory without an optimizer, is refused in one line when the state is built."""

from __future__ import annotations

import pytest
import torch

from elastic.sharded.modules import load_scheduler, scheduler_state
from elastic.sharded.state import ShardedState


def build():
    return torch.nn.Linear(3, 2)


def test_a_scheduler_object_or_a_factory_without_optimizer_is_refused_in_one_line():
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    made = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    for kwargs in ({"optimizer": lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "scheduler": made},
                   {"scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2)}):
        with pytest.raises(TypeError) as refused:
            ShardedState(model=build, **kwargs)
        assert "\n" not in str(refused.value) and "factory of the optimizer" in str(refused.value)


def test_a_scheduler_built_on_a_new_optimizer_takes_the_committed_state():
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    saved, groups = scheduler_state(scheduler), optimizer.state_dict()
    # A new ring: the optimizer, then the scheduler (which writes the initial rate), then
    # the optimizer's committed groups, then the scheduler's state.
    fresh_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fresh = torch.optim.lr_scheduler.StepLR(fresh_optimizer, 2, gamma=0.5)
    fresh_optimizer.load_state_dict(groups)
    load_scheduler(fresh, saved)
    assert fresh.last_epoch == 5 and fresh.get_last_lr() == scheduler.get_last_lr()
    optimizer.step(), scheduler.step(), fresh_optimizer.step(), fresh.step()
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 0.1 * 0.5 ** 3
