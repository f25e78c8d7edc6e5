"""The benchmark script core: a ~1.5M-parameter MLP under DDP (gloo, SGD momentum).

Two entry modes share the same model, data and step:

    torchrun --standalone --nproc-per-node 4 -m benchmarks.workload --mode torchrun \
        --timing-dir D --checkpoint D/ckpt.pt --checkpoint-every 20
    elastic-run --np 4 --min-np 2 --max-np 4 -m benchmarks.workload --mode elastic \
        --timing-dir D --commit-every 1

`torchrun` mode is what a plain torchrun script does (env:// init, rank 0 writes a
checkpoint file every N steps, every worker reloads it at start); `elastic` mode uses
the elastic API (TorchState, @elastic.run, commit every --commit-every steps).
Run it as a module from the repository root (as above): run as a script, benchmarks/
would come first on sys.path, where benchmarks/checkpoint.py shadows `checkpoint`.

Each worker appends "<step> <unix time>" after every completed step to
<timing-dir>/rank<R>.<pid>.steps (R = the rank at start). The file is line-buffered:
one small write per step, so the recovery benchmark sees the steps right after a kill.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

IN_FEATURES, HIDDEN, CLASSES = 512, 1024, 10  # 1.58M parameters
DATASET_SIZE = 4096


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["torchrun", "elastic"], required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-dir", help="where each worker appends its step timestamps")
    parser.add_argument("--checkpoint", help="torchrun mode: checkpoint file (loaded at start if present)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="torchrun mode: steps; 0 = never")
    parser.add_argument("--commit-every", type=int, default=1, help="elastic mode: steps; 0 = never")
    parser.add_argument("--state-mb", type=float, default=0.0,
                        help="grow the state (parameters + momentum, fp32) to about this many MB with ballast")
    parser.add_argument("--ddp-init-sync", action="store_true",
                        help="elastic mode: let DDP broadcast the parameters at construction (the old way)")
    return parser.parse_args(argv)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def add_ballast(model: nn.Module, optimizer: torch.optim.Optimizer, state_mb: float, seed: int) -> None:
    """Grow the state to ``state_mb`` MB without making a step slower: a frozen parameter
    (in the state dict, in DDP's initial broadcast, not in its gradient all-reduce) and a
    momentum buffer of the same size in the optimizer's state (SGD leaves both alone,
    since the parameter gets no gradient). What a recovery or a join moves grows as with
    a bigger model; the step time stays the base model's."""
    base_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # params + momentum
    floats = int((state_mb * 1e6 - base_bytes) / 8)
    if floats <= 0:
        return
    generator = torch.Generator().manual_seed(seed + 2)
    ballast = nn.Parameter(torch.rand(floats, generator=generator), requires_grad=False)
    model.register_parameter("ballast", ballast)
    optimizer.add_param_group({"params": [ballast]})
    optimizer.state[ballast]["momentum_buffer"] = torch.rand(floats, generator=generator)


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic, fixed by the seed: inputs and the labels of a random linear teacher."""
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(DATASET_SIZE, IN_FEATURES, generator=generator)
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=generator)
    return x, (x @ teacher).argmax(dim=1)


def batch_for(data, step: int, rank: int, world: int, batch_size: int):
    x, y = data
    start = ((step * world + rank) * batch_size) % (DATASET_SIZE - batch_size)
    return x[start : start + batch_size], y[start : start + batch_size]


def train_step(ddp, optimizer, data, step: int, rank: int, world: int, batch_size: int) -> None:
    x, y = batch_for(data, step, rank, world, batch_size)
    loss = F.cross_entropy(ddp(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


class StepLog:
    """Appends "<step> <time>" per completed step; a no-op without a timing dir."""

    def __init__(self, timing_dir: str | None, rank: int) -> None:
        self._file = None
        if timing_dir:
            os.makedirs(timing_dir, exist_ok=True)
            path = os.path.join(timing_dir, f"rank{rank}.{os.getpid()}.steps")
            self._file = open(path, "a", buffering=1)  # line-buffered: one write per step

    def done(self, step: int) -> None:
        if self._file is not None:
            self._file.write(f"{step} {time.time():.6f}\n")


def run_torchrun(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    model, data = make_model(args.seed), make_data(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    add_ballast(model, optimizer, args.state_mb, args.seed)
    step = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
    ddp = DDP(model)
    log = StepLog(args.timing_dir, rank)
    while step < args.steps:
        train_step(ddp, optimizer, data, step, rank, world, args.batch_size)
        step += 1
        log.done(step)
        if rank == 0 and args.checkpoint and args.checkpoint_every and step % args.checkpoint_every == 0:
            save_atomically({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                            args.checkpoint)
    dist.destroy_process_group()


def save_atomically(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_elastic(args) -> None:
    import elastic  # only this mode needs the project installed

    elastic.init()
    model, data = make_model(args.seed), make_data(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    add_ballast(model, optimizer, args.state_mb, args.seed)
    state = elastic.TorchState(model=model, optimizer=optimizer, step=0)
    log = StepLog(args.timing_dir, elastic.rank())

    @elastic.run
    def train(state):
        if not dist.is_initialized():
            ddp = state.model
        elif args.ddp_init_sync:
            ddp = DDP(state.model)
        else:
            ddp = DDP(state.model, init_sync=False)  # state.sync() made every copy equal
        rank, world = elastic.rank(), elastic.size()
        while state.step < args.steps:
            train_step(ddp, state.optimizer, data, state.step, rank, world, args.batch_size)
            state.step += 1
            log.done(state.step)
            if args.commit_every and state.step % args.commit_every == 0:
                state.commit()

    train(state)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mode == "torchrun":
        run_torchrun(args)
    else:
        run_elastic(args)


if __name__ == "__main__":
    main()
