"""Horovod's DistributedOptimizer against DDP: step time on the same model and data, same run.

    python -m benchmarks.horovod [--np 2] [--rounds 5] [--steps 30] [--json PATH]

One elastic-run job of --np workers; every worker trains three copies of one MLP
(same initial weights, same batches), in blocks of --steps steps, the order of the
blocks rotating every round:
  ddp              DistributedDataParallel + SGD (momentum): DDP's bucketed hooks
  hvd              hvd.DistributedOptimizer(SGD): all-reduces started by the
                   gradient hooks while backward runs (the goal: <= 1.05x DDP)
  hvd-after-bwd    the same all-reduces issued only after backward (no overlap),
                   to show what the overlap is worth
A block's step time is the median of its steps after the first --warmup; each
configuration's figure is the median over rounds, and its ratio the median of the
per-round ratios to that round's ddp block. Rank 0 writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

CONFIGS = ("ddp", "hvd", "hvd-after-bwd")
TARGET = 1.05


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, dest="nproc")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="steps per block")
    parser.add_argument("--warmup", type=int, default=5, help="steps of a block left out of its median")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set when run as a worker
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    return args


# -- the worker ------------------------------------------------------------------------
def _model(args):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(args.width, 10))


def _block(name, model, opt, args, step0, hvd):
    import torch
    import torch.nn.functional as F

    times = []
    for step in range(step0, step0 + args.steps):
        g = torch.Generator().manual_seed(step * 100 + hvd.rank())
        x = torch.randn(args.batch_size, args.width, generator=g)
        y = torch.randint(0, 10, (args.batch_size,), generator=g)
        started = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if name == "hvd-after-bwd":
            grads = [p.grad for p in model.parameters()]
            hvd.grouped_allreduce_(grads, op=hvd.Average)
        opt.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[args.warmup:])


def worker(args) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import elastic.horovod as hvd

    torch.set_num_threads(1)
    hvd.init()
    models = {name: _model(args) for name in CONFIGS}
    optimizers = {
        "ddp": torch.optim.SGD((ddp := DDP(models["ddp"])).parameters(), lr=0.01, momentum=0.9),
        "hvd": hvd.DistributedOptimizer(torch.optim.SGD(models["hvd"].parameters(), lr=0.01, momentum=0.9),
                                        named_parameters=models["hvd"].named_parameters()),
        "hvd-after-bwd": torch.optim.SGD(models["hvd-after-bwd"].parameters(), lr=0.01, momentum=0.9),
    }
    models["ddp"] = ddp
    rounds = []
    for round_no in range(args.rounds):
        order = CONFIGS[round_no % len(CONFIGS):] + CONFIGS[:round_no % len(CONFIGS)]
        figures = {}
        for name in order:
            # Every configuration trains on the same batches (rank, step): same weights.
            figures[name] = _block(name, models[name], optimizers[name], args, round_no * args.steps, hvd)
        rounds.append(figures)
    # The three copies saw the same data: their weights must agree (a sanity check of the sums).
    reference = [p.detach() for p in models["hvd"].parameters()]
    drift = max(float((a.detach() - b).abs().max()) for a, b in zip(models["ddp"].module.parameters(), reference))
    if hvd.rank() == 0:
        params = sum(p.numel() for p in models["hvd"].parameters())
        Path(args.worker_out).write_text(json.dumps({"rounds": rounds, "world": hvd.size(), "params": params,
                                                     "max_weight_difference_ddp_vs_hvd": drift}))


# -- the launcher ----------------------------------------------------------------------
def summarize(record: dict) -> dict:
    rounds = record["rounds"]
    out = {}
    for name in CONFIGS:
        out[name] = {
            "median_step_ms": 1000 * statistics.median(r[name] for r in rounds),
            "best_step_ms": 1000 * min(r[name] for r in rounds),
            "ratio_to_ddp": statistics.median(r[name] / r["ddp"] for r in rounds),
        }
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker_out:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-horovod-") as tmp:
        workdir = Path(tmp)
        out = workdir / "figures.json"
        passed = [f"--rounds={args.rounds}", f"--steps={args.steps}", f"--warmup={args.warmup}",
                  f"--layers={args.layers}", f"--width={args.width}", f"--batch-size={args.batch_size}"]
        command = [str(harness.BIN / "elastic-run"), "--np", str(args.nproc), "--log-dir", str(workdir / "logs"),
                   "-m", "benchmarks.horovod", *passed, "--worker-out", str(out)]
        with harness.Job(command, harness.benchmark_env(), workdir / "launcher.log") as job:
            exit_code = job.wait(1800)
        if exit_code != 0 or not out.exists():
            print((workdir / "launcher.log").read_text(errors="replace")[-3000:], file=sys.stderr)
            raise SystemExit(f"benchmark job failed (exit {exit_code})")
        record = json.loads(out.read_text())
    figures = summarize(record)
    print(f"{record['world']} workers, {record['params'] / 1e6:.2f}M parameters, {args.rounds} rounds of "
          f"{args.steps} steps per configuration; weights ddp vs hvd differ by at most "
          f"{record['max_weight_difference_ddp_vs_hvd']:.2e}")
    print("| config | median step | best block | ratio to DDP (median of rounds) |")
    print("|---|---|---|---|")
    for name, f in figures.items():
        goal = f" (goal <= {TARGET}x: {'met' if f['ratio_to_ddp'] <= TARGET else 'not met'})" if name == "hvd" else ""
        print(f"| {name} | {f['median_step_ms']:.1f} ms | {f['best_step_ms']:.1f} ms | "
              f"{f['ratio_to_ddp']:.3f}x{goal} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "raw": record, "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
