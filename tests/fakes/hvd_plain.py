"""A Horovod script without its elastic API, in the style of Horovod's own examples
(pytorch_synthetic_benchmark.py): ``hvd.init``, ``DistributedOptimizer``,
``broadcast_parameters``, a plain loop. Run under ``elastic-run --horovod-shim``.

Each worker prints ``rank R pid P size N`` once its parameters are broadcast, and rank 0
``step S`` every 20 steps; with ``--snapshot FILE`` rank 0 saves the step there every 20
steps and every worker resumes from it (the script's own checkpoint, as torchrun scripts
have), and rank 0 writes ``--out`` (JSON: steps, size) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--snapshot")
parser.add_argument("--out")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(10, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
start = 0
if args.snapshot and os.path.exists(args.snapshot):
    saved = torch.load(args.snapshot, weights_only=True)
    model.load_state_dict(saved["model"])
    start = saved["step"]
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
print(f"rank {hvd.rank()} pid {os.getpid()} size {hvd.size()} from step {start}", flush=True)
for step in range(start, args.steps):
    loss = model(torch.randn(8, 10)).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(args.step_delay)
    if hvd.rank() == 0 and (step + 1) % 20 == 0:
        print(f"step {step + 1}", flush=True)
        if args.snapshot:
            torch.save({"model": model.state_dict(), "step": step + 1}, args.snapshot + ".tmp")
            os.replace(args.snapshot + ".tmp", args.snapshot)
if hvd.rank() == 0 and args.out:
    with open(args.out, "w") as f:
        json.dump({"steps": args.steps, "size": hvd.size(), "resumed_from": start}, f)
