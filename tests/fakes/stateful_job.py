"""A training loop as real programs write it: an LR scheduler (OneCycleLR), a GradScaler
under CPU autocast, EMA weights (AveragedModel) and gradient accumulation, all in one
elastic.TorchState; deterministic, so a test compares it with a plain run of itself.

Each step takes the global batch ``step`` of a fixed data set; rank r takes rows
r::world of it, in two micro-batches whose gradients accumulate; a sum loss over the
global batch size and a summed all-reduce make every step equal a world of one's.
The model is float64, which autocast leaves alone: the scaler, the autocast region and
the accumulation run as in a mixed-precision program, the trajectory stays exact.

Files written to --out (one line per event, flushed at once):
  pids.jsonl      {"pid", "rank", "round", "world"} at every (re-)entry
  steps.jsonl     {"pid", "rank", "world", "round", "step", "lr", "next_lr", "scale",
                  "n_averaged"} per completed step: "lr" the rate the step used
  final-<pid>.pt  {"model": ..., "ema": ...}: the final float64 parameters
  killed-<step>   written by --kill-rank right before it SIGKILLs itself (once per job)
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import elastic

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--global-batch", type=int, default=12)
p.add_argument("--step-delay", type=float, default=0.0)
p.add_argument("--commit-every", type=int, default=1)
p.add_argument("--kill-rank", type=int, default=None, help="this rank SIGKILLs itself ...")
p.add_argument("--kill-step", type=int, default=None, help="... mid-step (after the backward, before the "
               "all-reduce) in this step, once per job")
p.add_argument("--hold-below-world", type=int, default=None,
               help="while the ring is smaller than this, commit in lockstep without training")
p.add_argument("--out", required=True)
args = p.parse_args()

torch.set_default_dtype(torch.float64)
elastic.init()
os.makedirs(args.out, exist_ok=True)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=args.steps + 1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=4)  # the scale grows during the run
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
gen = torch.Generator().manual_seed(1234)
X = torch.randn(args.steps * args.global_batch, 8, generator=gen)
Y = torch.randint(0, 3, (X.shape[0],), generator=gen)
state = elastic.TorchState(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, ema=ema, step=0)


def append(name, record):
    with open(os.path.join(args.out, name), "a") as f:
        f.write(json.dumps(record) + "\n")


def maybe_die(step: int) -> None:
    if step != args.kill_step or elastic.rank() != args.kill_rank:
        return
    marker = os.path.join(args.out, f"killed-{step}")
    if os.path.exists(marker):
        return
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


def hold_until_the_ring_grows():
    """Commit in lockstep without training while the ring is small, so the joiner arrives
    before the end however slowly it starts (a grow is applied at a commit)."""
    while args.hold_below_world and elastic.size() < args.hold_below_world:
        dist.barrier()
        time.sleep(0.05)
        state.commit()


@elastic.run
def train(state):
    rank, world = elastic.rank(), elastic.size()
    append("pids.jsonl", {"pid": os.getpid(), "rank": rank, "round": elastic.round(), "world": world})
    while state.step < args.steps:
        hold_until_the_ring_grows()
        start = state.step * args.global_batch
        rows = torch.arange(start, start + args.global_batch)[rank::world]
        lr = state.optimizer.param_groups[0]["lr"]
        state.optimizer.zero_grad()
        for micro in torch.tensor_split(rows, 2):  # gradient accumulation over two micro-batches
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(state.model(X[micro]), Y[micro], reduction="sum") / args.global_batch
            state.scaler.scale(loss).backward()
        maybe_die(state.step + 1)
        if world > 1:
            for param in state.model.parameters():
                dist.all_reduce(param.grad)
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.scheduler.step()
        state.ema.update_parameters(state.model)
        state.step += 1
        append("steps.jsonl", {"pid": os.getpid(), "rank": rank, "world": world, "round": elastic.round(),
                               "step": state.step, "lr": lr, "next_lr": state.scheduler.get_last_lr()[0],
                               "scale": state.scaler.get_scale(), "n_averaged": int(state.ema.n_averaged)})
        time.sleep(args.step_delay)
        if state.step % args.commit_every == 0:
            state.commit()


train(state)
torch.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "ema": {k: v.detach().clone() for k, v in ema.state_dict().items()}},
           os.path.join(args.out, f"final-{os.getpid()}.pt"))
