"""A Horovod elastic script, as Horovod's users write them, with one import line changed.

float64 linear regression: ``hvd.DistributedOptimizer`` (SGD with momentum), an
``hvd.elastic.ElasticSampler`` under a name of the script's choosing, a
``hvd.elastic.TorchState`` with the model and optimizer positional, ``@hvd.elastic.run``,
``state.commit()`` every ``--commit-every`` steps and ``state.check_host_updates()``
at the others, a reset callback. It writes under ``--out``:

  pids.jsonl    {"pid", "rank", "round", "world"} at every (re-)entry of train()
  steps.jsonl   {"pid", "rank", "world", "round", "step", "epoch", "indices"} per step
  resets.jsonl  {"pid", "rank", "round", "world", "epoch", "step", "checksum"} per reset callback
  checks.jsonl  {"pid", "rank", "round", "step"} when check_host_updates took a change
  final-<rank>.pt  the model's parameters at the end

The test replays steps.jsonl in one plain process (tests/integration/test_horovod_elastic.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import elastic
import elastic.horovod as hvd

FEATURES = 6
LR, MOMENTUM = 0.05, 0.9


def data(n: int):
    """The data set (the test builds the same one)."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(n, FEATURES, generator=gen, dtype=torch.float64)
    y = x @ torch.linspace(-1, 1, FEATURES, dtype=torch.float64).unsqueeze(1) + 0.1 * torch.randn(
        n, 1, generator=gen, dtype=torch.float64)
    return x, y


def new_model():
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1).double()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--dataset-size", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--commit-every", type=int, default=1, help="check_host_updates() at the other steps")
    p.add_argument("--stop-file", required=True, help="stop (all ranks at one step) once this file exists")
    p.add_argument("--step-delay", type=float, default=0.05)
    return p.parse_args()


def main(args) -> None:
    def append(name: str, record: dict) -> None:
        with open(os.path.join(args.out, name), "a") as f:
            f.write(json.dumps(record) + "\n")

    os.makedirs(args.out, exist_ok=True)
    hvd.init()
    x, y = data(args.dataset_size)
    dataset = TensorDataset(x, y, torch.arange(args.dataset_size))
    model = new_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    def where() -> dict:
        return {"pid": os.getpid(), "rank": hvd.rank(), "world": hvd.size(), "round": elastic.round()}

    def stop_now() -> bool:
        """Rank 0 looks for --stop-file and tells the ring (an allreduce: every rank stops at one step)."""
        mine = 1.0 if hvd.rank() == 0 and os.path.exists(args.stop_file) else 0.0
        return hvd.allreduce(torch.tensor([mine]), op=hvd.Max, name="stop").item() > 0

    @hvd.elastic.run
    def train(state):
        append("pids.jsonl", where())
        while state.epoch < args.epochs:
            for idx, (xb, yb, indices) in enumerate(loader):
                if stop_now():
                    return state.step
                # The record is written before the all-reduce: a worker killed after the
                # all-reduce but before a later write would leave a step that the survivors
                # committed with its gradient and no record of its samples. A record of a
                # step that never completed is superseded by the newer round that re-ran it.
                append("steps.jsonl", {**where(), "step": state.step + 1, "epoch": state.epoch,
                                       "indices": indices.tolist()})
                state.optimizer.zero_grad()
                F.mse_loss(state.model(xb), yb).backward()
                state.optimizer.step()
                state.data.record_batch(idx, args.batch_size)
                state.step += 1
                if state.step % args.commit_every == 0:
                    state.commit()
                else:
                    try:
                        state.check_host_updates()
                    except hvd.elastic.HostsUpdatedInterrupt:
                        append("checks.jsonl", {**where(), "step": state.step})
                        raise
                time.sleep(args.step_delay)
            state.epoch += 1
            state.data.set_epoch(state.epoch)  # at the end of the epoch, as Horovod asks
            state.commit()
        return state.step

    state = hvd.elastic.TorchState(model, optimizer, data=sampler, epoch=0, step=0)

    def on_state_reset():
        checksum = sum(float(p.sum()) for p in model.parameters())
        append("resets.jsonl", {**where(), "epoch": state.epoch, "step": state.step, "checksum": checksum})

    state.register_reset_callbacks([on_state_reset])
    train(state)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(args.out, f"final-{hvd.rank()}.pt"))


if __name__ == "__main__":
    main(parse_args())
