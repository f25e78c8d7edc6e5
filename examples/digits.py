"""A small real training job on the elastic API: an MLP on scikit-learn's digits.

    python examples/digits.py --epochs 2                  # alone: a world of one
    elastic-run --np 4 --min-np 2 examples/digits.py --epochs 20 --step-delay 0.05
    elastic-run --np 4 --min-np 2 examples/digits.py --global-batch-size 100

The data set ships with scikit-learn (no download). The train/test split is fixed by
--seed, so every worker holds the same split; the ElasticSampler hands each rank its
share of the epoch, and its progress is part of the committed state, so after a
resize every training sample of an epoch is still seen exactly once.

With --global-batch-size G every step trains on the same G samples at any world
size (a sum loss times ``sampler.loss_scale``), so a run that loses or gains
workers follows the trajectory of a run that does not; --micro-batch-size M
accumulates each worker's share in pieces of at most M.
"""

from __future__ import annotations

import argparse
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
    raise SystemExit("digits.py needs scikit-learn: pip install scikit-learn")
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elastic


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker (without --global-batch-size)")
    parser.add_argument("--global-batch-size", type=int, help="samples per step over all workers, at any world size")
    parser.add_argument("--micro-batch-size", type=int, help="with --global-batch-size: accumulate in pieces of this")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--float64", action="store_true", help="train in float64 (bit-for-bit comparisons)")
    parser.add_argument("--commit-every", type=int, default=1, help="commit every N steps")
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (demos, kill tests)")
    parser.add_argument("--out", help="rank 0 writes final params + accuracy here (JSON)")
    parser.add_argument("--progress", help="every worker appends one JSON line per step here (tests)")
    parser.add_argument("--stop-file", help="finish early, at one step on every rank, once this file exists (tests)")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.commit_every < 1:
        parser.error("--epochs, --batch-size and --commit-every must be >= 1")
    if any(value is not None and value < 1 for value in (args.global_batch_size, args.micro_batch_size)):
        parser.error("--global-batch-size and --micro-batch-size must be >= 1")
    if args.micro_batch_size is not None and args.global_batch_size is None:
        parser.error("--micro-batch-size needs --global-batch-size")
    return args


def load_split(seed: int, dtype: torch.dtype) -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.25, random_state=seed, stratify=digits.target
    )

    def dataset(x, y):
        return TensorDataset(torch.tensor(x, dtype=dtype), torch.tensor(y, dtype=torch.long))

    return dataset(x_train, y_train), dataset(x_test, y_test)


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on the whole data set; identical on every rank."""
    x, y = data.tensors
    logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(dim=1) == y).float().mean().item()


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype = torch.float64 if args.float64 else torch.float32
    torch.set_default_dtype(dtype)
    torch.manual_seed(args.seed)
    elastic.init()

    train_data, test_data = load_split(args.seed, dtype)
    model = make_model(args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    sampler = elastic.ElasticSampler(train_data, shuffle=True, seed=args.seed)
    state = elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)

    @elastic.run
    def train(state):
        # DDP is bound to the current ring: re-created every time train is re-entered.
        # init_sync=False: state.sync() already made every worker's parameters equal,
        # so DDP's own initial broadcast would move the whole model once more.
        ddp = DDP(state.model, init_sync=False) if dist.is_initialized() else state.model
        for state.epoch in range(state.epoch, args.epochs):
            state.sampler.set_epoch(state.epoch)  # same epoch again after a re-form: keeps progress
            for batch_idx, batch in enumerate(epoch_batches(args, state.sampler, train_data)):
                if args.stop_file and stop_requested(args.stop_file):
                    state.commit()
                    return
                state.optimizer.zero_grad()
                if args.global_batch_size:
                    global_batch_step(ddp, state.sampler, train_data, batch, args.micro_batch_size is not None)
                    state.optimizer.step()
                    state.sampler.record_batch(batch_idx)  # the whole global batch
                else:
                    x, y = batch
                    F.cross_entropy(ddp(x), y).backward()
                    state.optimizer.step()
                    state.sampler.record_batch(batch_idx, args.batch_size)
                state.step += 1
                if args.progress:
                    record_progress(args.progress, state)
                if args.step_delay:
                    time.sleep(args.step_delay)
                if state.step % args.commit_every == 0:
                    state.commit()
            if elastic.rank() == 0:
                train_loss, _ = evaluate(state.model, train_data)
                print(f"epoch {state.epoch} step {state.step} world {elastic.size()} "
                      f"train_loss {train_loss:.4f}", flush=True)
        state.commit()

    train(state)

    test_loss, accuracy = evaluate(state.model, test_data)
    if elastic.rank() == 0:
        print(f"test_loss {test_loss:.4f} test_accuracy {accuracy:.4f}", flush=True)
        if args.out:
            write_result(args.out, state, accuracy, test_loss)


def epoch_batches(args, sampler: elastic.ElasticSampler, data: TensorDataset):
    """This epoch's batches on this rank: the same number on every rank (DDP needs that)."""
    if args.global_batch_size:
        # This rank's share of each global batch, as index lists (micro-batches with M).
        return sampler.batches(global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size)
    return DataLoader(data, batch_sampler=sampler.batches(args.batch_size))


def global_batch_step(ddp, sampler: elastic.ElasticSampler, data: TensorDataset, rows, micro: bool) -> None:
    """Gradients of the mean loss over the global batch, whatever this rank's share is.

    A sum loss times loss_scale (W / G), averaged by DDP over W ranks, is the mean
    over the G samples. The data is indexed directly, not through a DataLoader: a
    short last global batch can leave a rank an empty share, which the default
    collate cannot batch; the rank still runs the step (zero rows, zero gradient).
    """
    x_all, y_all = data.tensors
    for piece in elastic.accumulate(ddp, rows if micro else [rows]):
        piece = torch.tensor(piece, dtype=torch.long)
        loss = F.cross_entropy(ddp(x_all[piece]), y_all[piece], reduction="sum") * sampler.loss_scale
        loss.backward()


def stop_requested(path: str) -> bool:
    """Rank 0 looks for the file and tells the ring, so every rank stops at the same step."""
    flag = torch.tensor([1 if elastic.rank() == 0 and os.path.exists(path) else 0])
    if dist.is_initialized():
        dist.broadcast(flag, src=0)
    return bool(flag.item())


def record_progress(path: str, state) -> None:
    """One line per finished step (before its commit): who ran which step in which ring."""
    line = json.dumps({"pid": os.getpid(), "rank": elastic.rank(), "world": elastic.size(),
                       "round": elastic.round(), "epoch": state.epoch, "step": state.step})
    with open(path, "a") as f:  # one short append per line: concurrent writers do not interleave
        f.write(line + "\n")


def write_result(path: str, state, accuracy: float, test_loss: float) -> None:
    """Atomically: the final parameters (as lists) and the test accuracy."""
    result = {
        "test_accuracy": accuracy,
        "test_loss": test_loss,
        "epoch": state.epoch,
        "step": state.step,
        "world_size": elastic.size(),
        "params": {name: p.detach().flatten().tolist() for name, p in state.model.named_parameters()},
    }
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
