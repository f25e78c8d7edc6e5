"""A sharded model at world 1 on CUDA (gpu review G6; the GPU run's sharded check).

Run under ``elastic-run --np 1 --backend auto`` on a GPU host: the default backend
(``cpu:gloo,cuda:nccl``) must put the FSDP2 model on the GPU. Trains a few steps on
CUDA batches, breaks its own ring once after a commit (so the commit is restored
through the sharded state's recovery path), and writes ``result.json`` to --out:
{"param_device", "steps", "rounds", "loss"}. A parameter on another device than CUDA
ends the script with a one-line error (the check reads it from the job's output).
"""

import argparse
import json
import os

import torch
import torch.nn as nn

import elastic
from elastic.worker import lifecycle

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--break-at", type=int, default=5, help="abort the ring once, after committing this step")
p.add_argument("--expect", default="cuda", choices=("cuda", "cpu"),
               help="where the model must live (cpu: the harness's own run on a CPU host, --backend gloo)")
p.add_argument("--out", required=True)
args = p.parse_args()
os.makedirs(args.out, exist_ok=True)


def build() -> nn.Module:
    torch.manual_seed(0)
    # A buffer as well as parameters: module buffers travel in the commit's metadata.
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))
    return model


elastic.init()
state = elastic.ShardedState(model=build, optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=0.01), step=0)
rounds = []


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@elastic.run
def train(state):
    rounds.append(elastic.round())
    device = local(next(state.model.parameters())).device
    if device.type != args.expect:
        raise SystemExit(f"sharded_world1: the sharded model lives on {device}, not on {args.expect}")
    gen = torch.Generator().manual_seed(7)
    loss = None
    while state.step < args.steps:
        x = torch.randn(8, 16, generator=gen).to(device)  # a script's batches go to its device
        loss = state.model(x).pow(2).mean()
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.step += 1
        state.commit()
        if state.step == args.break_at and len(rounds) == 1:
            lifecycle.ring().abort()  # the next collective fails: recovery restores the commit
            torch.distributed.barrier()
    return str(device), None if loss is None else float(loss)


device, loss = train(state)
with open(os.path.join(args.out, "result.json"), "w") as f:
    json.dump({"param_device": device, "steps": state.step, "rounds": rounds, "loss": loss}, f)
