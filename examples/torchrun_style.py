"""A plain torchrun-style script (no elastic API): DDP MLP on scikit-learn's digits.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_style.py --steps 200 --snapshot /tmp/s.pt
    elastic-run --np 2 examples/torchrun_style.py --steps 200 --snapshot /tmp/s.pt

It reads RANK / WORLD_SIZE / LOCAL_RANK like any torchrun script, and survives
restarts the torchrun way: rank 0 saves a snapshot every --snapshot-every steps
(atomically: temporary file, fsync, rename) and every worker reloads it at start.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ImportError:  # one line, not a traceback per worker
    raise SystemExit("torchrun_style.py needs scikit-learn: pip install scikit-learn")
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot", help="snapshot file: saved every --snapshot-every steps, loaded at start")
    parser.add_argument("--snapshot-every", type=int, default=20)
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep per step")
    parser.add_argument("--out", help="rank 0 writes final accuracy, step and world size here (JSON)")
    return parser.parse_args(argv)


def atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dist.init_process_group("gloo")  # MASTER_ADDR / MASTER_PORT from the environment
    torch.manual_seed(args.seed)

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.25, random_state=args.seed, stratify=digits.target
    )
    train = TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    step = 0
    if args.snapshot and os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot, weights_only=True)
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        step = snap["step"]
        print(f"rank {rank} (local {local_rank}): resumed from step {step}", flush=True)

    ddp = DDP(model)  # broadcasts rank 0's parameters to every rank
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    steps_per_epoch = len(loader)

    while step < args.steps:
        epoch, skip = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)
        for x, y in itertools.islice(loader, skip, None):  # resume mid-epoch
            loss = F.cross_entropy(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if args.step_delay:
                time.sleep(args.step_delay)
            if rank == 0 and args.snapshot and step % args.snapshot_every == 0:
                atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                            args.snapshot)
            if step >= args.steps:
                break
        if rank == 0:
            print(f"epoch {epoch} step {step} world {world} loss {loss.item():.4f}", flush=True)

    with torch.no_grad():
        x, y = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    if rank == 0:
        print(f"test_accuracy {accuracy:.4f}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"test_accuracy": accuracy, "step": step, "world_size": world}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
