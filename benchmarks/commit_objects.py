"""Commit cost with a scheduler, a GradScaler and EMA weights in the state.

    python -m benchmarks.commit_objects [--json PATH] [--sizes 0.1,5,25] [--reps 21]

``TorchState.commit()`` (a world of one, a stand-in runtime: the snapshot copy and
nothing else) of two states built on the same model of N float32 parameters with SGD
momentum: "model+opt" alone, and "+objects" with a OneCycleLR scheduler, a CPU
GradScaler and an ``AveragedModel`` (EMA) copy of the weights. Each is measured against
one ``copy_`` of the same number of bytes into a reused buffer, interleaved in the same
run (median of reps): the objects must cost what their tensors cost (EMA weights) and
close to nothing else (the scheduler's and the scaler's state_dicts are plain values).
Target, as ``benchmarks/checkpoint.py``'s for the model: ratio <= 1.4. The smallest
size shows the fixed cost per commit instead: the EMA's ``state_dict()`` and its
tensors' copies cost what the model's do per tensor.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from benchmarks.harness import write_json_report
from elastic.contract.events import EventLog
from elastic.state import TorchState
from elastic.worker import lifecycle
from elastic.worker.local_ring import LocalRing
from elastic.worker.session import WorkerSession
from elastic.worker.step_log import StepLog

TARGET = 1.4
LAYERS = 24


def build(params: int, objects: bool) -> TorchState:
    """A state whose model has ``params`` float32 parameters in LAYERS square layers, one step
    trained (the optimizer's momentum exists), with or without the stateful objects."""
    width = max(8, int((params / LAYERS) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(LAYERS)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    extra = {}
    if objects:
        extra = {
            "scheduler": torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=1000),
            "scaler": torch.amp.GradScaler("cpu"),
            "ema": AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999)),
        }
    optimizer.zero_grad()
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    if objects:
        extra["scheduler"].step()
        extra["ema"].update_parameters(model)
    return TorchState(model=model, optimizer=optimizer, step=0, **extra)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(params: int, objects: bool, reps: int) -> dict:
    state = build(params, objects)
    state.commit()  # allocation happens here, once
    nbytes = sum(b.numel() * b.element_size() for b in state._book.snapshot.buffers())
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # both sides start warm
    copy_times, commit_times = [], []
    for _ in range(reps):  # interleaved, so both see the same machine noise
        copy_times.append(_timed(lambda: dst.copy_(src)))
        commit_times.append(_timed(state.commit))
    copy_s, commit_s = statistics.median(copy_times), statistics.median(commit_times)
    result = {
        "state": "+objects" if objects else "model+opt",
        "params": params,
        "bytes": nbytes,
        "tensors": len(state._book.snapshot.layout().tensors),
        "copy_ms": copy_s * 1e3,
        "commit_ms": commit_s * 1e3,
        "ratio": commit_s / copy_s,
        # The least disturbed rep of each: on a shared, loaded machine the medians move by
        # several times from run to run, the minima far less.
        "copy_min_ms": min(copy_times) * 1e3,
        "commit_min_ms": min(commit_times) * 1e3,
        "ratio_min": min(commit_times) / min(copy_times),
        "target": TARGET,
        "reps": reps,
        "threads": torch.get_num_threads(),
        "loadavg_1min": os.getloadavg()[0],
    }
    result["ok"] = result["ratio"] <= TARGET
    del state, src, dst
    gc.collect()
    return result


def _print_table(results: list[dict]) -> None:
    print("commit of a TorchState vs one copy_ of the same bytes into a reused buffer")
    print(f"{'params':>8} {'state':>10} {'MB':>7} {'tensors':>7} {'threads':>7} {'copy_ ms':>9} {'commit ms':>10} "
          f"{'ratio':>6} {'target':>7}  ok  {'min: copy_':>10} {'commit':>7} {'ratio':>6}   load")
    for r in results:
        print(f"{r['params'] / 1e6:>7.0f}M {r['state']:>10} {r['bytes'] / 1e6:>7.0f} {r['tensors']:>7} "
              f"{r['threads']:>7} {r['copy_ms']:>9.1f} {r['commit_ms']:>10.1f} {r['ratio']:>6.2f} "
              f"{'<=' + str(r['target']):>7}  {'yes' if r['ok'] else 'NO':<3} {r['copy_min_ms']:>10.1f} "
              f"{r['commit_min_ms']:>7.1f} {r['ratio_min']:>6.2f}  {r['loadavg_1min']:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.commit_objects", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--sizes", default="0.1,5,25",
                        help="model parameter counts in millions (default 0.1,5,25; at 0.1 a commit is its fixed "
                             "per-tensor Python cost, the ratio means nothing there)")
    parser.add_argument("--reps", type=int, default=21)
    args = parser.parse_args(argv)
    try:
        sizes = [int(float(s) * 1_000_000) for s in args.sizes.split(",") if s]
    except ValueError:
        parser.exit(2, f"--sizes: a comma-separated list of numbers, got {args.sizes!r}\n")
    if not sizes or min(sizes) <= 0 or args.reps < 1:
        parser.exit(2, "--sizes and --reps must be positive\n")

    # A commit in a world of one (no process group needed for it): what it costs besides the
    # copy is a step record, as a job's ring check and left-behind check nearly are nothing
    # between membership changes.
    events = EventLog(None, host="local")
    lifecycle.install(WorkerSession.serving(LocalRing(events, StepLog(events, "local"))))
    # As benchmarks/checkpoint.py: workers run several per host with 1 intra-op thread.
    thread_settings = sorted({torch.get_num_threads(), 1}, reverse=True)
    previous_threads = torch.get_num_threads()
    results = []
    try:
        for threads in thread_settings:
            torch.set_num_threads(threads)
            for n in sizes:
                for objects in (False, True):
                    results.append(bench(n, objects, args.reps))
    finally:
        torch.set_num_threads(previous_threads)
        lifecycle.install(None)
    _print_table(results)
    if args.json:
        write_json_report(args.json, "commit_objects", commit=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
