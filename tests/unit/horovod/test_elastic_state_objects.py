"""hvd.elastic.TorchState takes a scheduler and a GradScaler as Horovod's does: through
their state_dict(), rolled back with the commit (the loading elastic.TorchState uses)."""

from __future__ import annotations

import torch


def test_a_scheduler_and_a_scaler_roll_back_with_the_commit(hvd):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    state = hvd.elastic.TorchState(model, optimizer, scheduler=scheduler, scaler=scaler, epoch=0)
    state.sync()

    def step():
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

    step()
    state.commit()
    committed = (scheduler.last_epoch, scheduler.get_last_lr(), optimizer.param_groups[0]["lr"], scaler.get_scale())
    step()
    step()
    assert scheduler.last_epoch == committed[0] + 2 and scaler.get_scale() == committed[3] * 4
    state.restore()
    assert (scheduler.last_epoch, scheduler.get_last_lr(), optimizer.param_groups[0]["lr"], scaler.get_scale()) \
        == committed
