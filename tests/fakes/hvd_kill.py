"""DistributedOptimizer through a SIGKILL: float64 training under elastic-run that must
end equal (1e-9) to the same computation in one plain process.

Every step's global batch is fixed (12 rows); rank r of a ring of n takes rows r::n,
so the averaged gradient is the whole batch's whatever the ring's size. With
``--kill-step S`` the last rank SIGKILLs itself at step S right after its backward
pass (its gradient all-reduces are under way): the others fail in ``step()``, roll
back to the last commit and go on in a new ring. Rank 0 writes ``<out>/result.json``
with the largest difference to the plain computation and the ring sizes it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import elastic  # noqa: E402
import elastic.horovod as hvd  # noqa: E402

ROWS = 12


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def global_batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, 6, generator=g, dtype=torch.float64), torch.randn(ROWS, 1, generator=g, dtype=torch.float64)


def plain(steps: int):
    model = make_model()
    opt = make_optimizer(model.parameters())
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=-1)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hvd.init()
    model = make_model()
    opt = hvd.DistributedOptimizer(make_optimizer(model.parameters()), named_parameters=model.named_parameters())
    state = elastic.TorchState(model=model, optimizer=opt, step=0)
    sizes = []

    @elastic.run
    def train(state):
        sizes.append(hvd.size())
        while state.step < args.steps:
            rank, size = hvd.rank(), hvd.size()
            x, y = global_batch(state.step)
            opt.zero_grad()
            ((model(x[rank::size]) - y[rank::size]) ** 2).mean().backward()
            marker = out / "killed"
            if state.step == args.kill_step and rank == size - 1 and size > 2 and not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            state.step += 1
            state.commit()

    train(state)
    if hvd.rank() == 0:
        reference = plain(args.steps)
        diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), reference.parameters()))
        (out / "result.json").write_text(json.dumps({"max_difference": diff, "sizes": sizes, "step": state.step}))


if __name__ == "__main__":
    main()
