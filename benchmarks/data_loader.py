"""The sharded source's loader against a plain DataLoader over the same token shards, and the
time from a re-formation to the first batch.

    python -m benchmarks.data_loader [--json PATH] [--shards 64] [--batches 40] [--reps 25]

Both loaders read the same uint16 token files (``--shards`` files of 2048 samples of 129
tokens, written to a temporary folder) with ``DataLoader(num_workers=2, prefetch_factor=4,
persistent_workers=True)`` and batches of 64:

* **elastic**: ``ShardedSource.tokens`` + ``SourceSampler(global_batch_size=64)`` as the
  batch sampler (the epoch's windowed shuffle, each batch read shard by shard in one
  ``__getitems__``), and ``record_batch`` after every batch, as a training loop calls it;
* **plain**: a map-style ``Dataset`` of the user's over the same files (a memmap per shard,
  a global index found with ``searchsorted``), ``shuffle=True``, the default collate.

Interleaved reps of ``--batches`` batches each, all within one pass of each loader (after
a warm-up rep that starts the workers; each loader first in every other rep), median and
best samples per second;
goal: elastic >= 0.95x plain. Many short reps rather than a few long ones: on a loaded
machine both loaders of a pair then see about the same neighbours. There the rates swing with the scheduler from
rep to rep, so the CPU time per sample (this process and the loader's workers, from
``/proc``) is printed too: what each loader costs, whatever the load. Then the time from a
re-formation to the first batch: the commit restored and the world changed
(``load_state_dict`` + ``set_rank``), the next ``iter(loader)`` keeps the workers (a new
pass sends them other ids), against building a fresh loader, whose workers start again.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.harness import write_json_report
from elastic.data import ShardedSource, SourceSampler

GOAL = 0.95
PER_SHARD, SEQ, BATCH = 2048, 129, 64
LOADER = dict(num_workers=2, prefetch_factor=4, persistent_workers=True)


class PlainTokens(Dataset):
    """What a user writes without the source: one memmap per shard, an index by searchsorted."""

    def __init__(self, paths):
        self.paths = paths
        counts = [os.path.getsize(p) // 2 // SEQ for p in paths]
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.maps = None

    def __len__(self):
        return int(self.starts[-1])

    def __getitem__(self, index):
        if self.maps is None:  # opened in the worker
            self.maps = [np.memmap(p, dtype=np.uint16, mode="r") for p in self.paths]
        shard = int(np.searchsorted(self.starts, index, side="right") - 1)
        offset = index - int(self.starts[shard])
        return torch.from_numpy(self.maps[shard][offset * SEQ:(offset + 1) * SEQ].astype(np.int64))


def write_shards(folder: str, shards: int) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for k in range(shards):
        path = os.path.join(folder, f"shard-{k:04d}.bin")
        rng.integers(0, 50257, size=PER_SHARD * SEQ, dtype=np.uint16).tofile(path)
        paths.append(path)
    return paths


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


class Steady:
    """One pass of a loader, pulled in chunks: the measured reps never restart a pass (a
    pass's start drains the previous one's prefetched batches and costs tens of ms,
    which would be most of a short rep)."""

    def __init__(self, loader, record=None):
        self.loader, self.record, self.step = loader, record, 0
        self.batches = iter(loader)

    def rate(self, batches: int) -> tuple[float, float]:
        """(samples per second, CPU microseconds per sample: this process and the loader's
        workers) over the next ``batches`` batches. On a loaded machine the first swings
        with the scheduler; the second is what the loader costs."""
        workers = [w.pid for w in self.loader._iterator._workers]
        start, cpu, samples = time.perf_counter(), time.process_time() + _cpu_s(workers), 0
        for _ in range(batches):
            samples += len(next(self.batches))
            if self.record is not None:
                self.record(self.step)
            self.step += 1
        wall = time.perf_counter() - start
        cpu = time.process_time() + _cpu_s(workers) - cpu
        return samples / wall, cpu / samples * 1e6


def first_batch_after_a_reformation(loader, sampler, reps: int) -> tuple[list[float], list[float]]:
    """(kept workers, fresh loader) seconds from the reset to the first batch."""
    kept, fresh = [], []
    for rep in range(reps):
        committed = sampler.state_dict()
        start = time.perf_counter()
        sampler.load_state_dict(committed)
        sampler.set_rank(rep % 2, 2)
        next(iter(loader))
        kept.append(time.perf_counter() - start)
        start = time.perf_counter()
        sampler.load_state_dict(committed)
        sampler.set_rank(rep % 2, 2)
        other = DataLoader(loader.dataset, batch_sampler=sampler, collate_fn=loader.collate_fn, **LOADER)
        next(iter(other))
        fresh.append(time.perf_counter() - start)
        del other
    sampler.set_rank(0, 1)
    return kept, fresh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_loader", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--batches", type=int, default=40, help="batches per rep")
    parser.add_argument("--reps", type=int, default=25)
    args = parser.parse_args(argv)
    if min(args.shards, args.batches, args.reps) < 1:
        parser.exit(2, "--shards, --batches and --reps must be positive\n")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as folder:
        paths = write_shards(folder, args.shards)
        source = ShardedSource.tokens(paths, seq_len=SEQ)
        sampler = SourceSampler(source, global_batch_size=BATCH, seed=0)
        elastic_loader = DataLoader(source, batch_sampler=sampler, collate_fn=source.collate, **LOADER)
        plain_loader = DataLoader(PlainTokens(paths), batch_size=BATCH, shuffle=True, **LOADER)
        if args.batches * (args.reps + 1) > len(source) // BATCH:
            parser.exit(2, f"--batches x (--reps + 1) must fit in one pass of {len(source) // BATCH} batches\n")
        elastic_pass, plain_pass = Steady(elastic_loader, sampler.record_batch), Steady(plain_loader)
        elastic_pass.rate(args.batches)  # the workers start, the passes are under way
        plain_pass.rate(args.batches)
        elastic_runs, plain_runs = [], []
        for rep in range(args.reps):  # interleaved, each first in turn: both see the same machine
            for steady, runs in [(elastic_pass, elastic_runs), (plain_pass, plain_runs)][::1 if rep % 2 == 0 else -1]:
                runs.append(steady.rate(args.batches))
        del elastic_pass, plain_pass
        elastic_rates, plain_rates = [r for r, _ in elastic_runs], [r for r, _ in plain_runs]
        kept, fresh = first_batch_after_a_reformation(elastic_loader, sampler, args.reps)
    throughput = {
        "samples_per_batch": BATCH, "tokens_per_sample": SEQ, "shards": args.shards, "batches": args.batches,
        "reps": args.reps, "elastic_samples_per_s": statistics.median(elastic_rates),
        "plain_samples_per_s": statistics.median(plain_rates),
        "elastic_best_samples_per_s": max(elastic_rates), "plain_best_samples_per_s": max(plain_rates),
        "elastic_cpu_us_per_sample": statistics.median(c for _, c in elastic_runs),
        "plain_cpu_us_per_sample": statistics.median(c for _, c in plain_runs),
        "elastic_all": elastic_rates, "plain_all": plain_rates, "goal": GOAL,
        "loadavg_1min": os.getloadavg()[0],
    }
    throughput["ratio"] = throughput["elastic_samples_per_s"] / throughput["plain_samples_per_s"]
    # Each rep's two loaders ran back to back: the median of their ratios is the paired figure.
    throughput["ratio_paired"] = statistics.median(e / p for e, p in zip(elastic_rates, plain_rates))
    throughput["ratio_best"] = throughput["elastic_best_samples_per_s"] / throughput["plain_best_samples_per_s"]
    throughput["cpu_ratio"] = throughput["plain_cpu_us_per_sample"] / throughput["elastic_cpu_us_per_sample"]
    throughput["ok"] = throughput["ratio"] >= GOAL
    first_batch = {"kept_workers_s": statistics.median(kept), "fresh_loader_s": statistics.median(fresh),
                   "kept_all": kept, "fresh_all": fresh}
    print(f"loader samples/s, batches of {BATCH} x {SEQ} uint16 tokens, {args.shards} shards, "
          f"DataLoader(num_workers=2, prefetch_factor=4, persistent_workers=True), median of {args.reps}")
    print(f"{'':>8} {'elastic':>9} {'plain':>9} {'ratio':>6} {'goal':>6}  ok")
    t = throughput
    print(f"{'median':>8} {t['elastic_samples_per_s']:>9.0f} {t['plain_samples_per_s']:>9.0f} {t['ratio']:>6.2f} "
          f"{'>=' + str(GOAL):>6}  {'yes' if t['ok'] else 'NO':<3}")
    print(f"{'paired':>8} {'':>9} {'':>9} {t['ratio_paired']:>6.2f}   (the median of each rep's elastic / plain)")
    print(f"{'best':>8} {t['elastic_best_samples_per_s']:>9.0f} {t['plain_best_samples_per_s']:>9.0f} "
          f"{t['ratio_best']:>6.2f}")
    print(f"CPU us per sample (this process and the loader's workers): elastic {t['elastic_cpu_us_per_sample']:.1f}, "
          f"plain {t['plain_cpu_us_per_sample']:.1f} (plain / elastic {t['cpu_ratio']:.2f}); "
          f"load {t['loadavg_1min']:.1f}")
    print("\nre-formation -> first batch (load_state_dict + set_rank + next(iter(loader)))")
    print(f"{'kept workers':>14} {'fresh loader':>14}")
    print(f"{first_batch['kept_workers_s'] * 1e3:>11.1f} ms {first_batch['fresh_loader_s'] * 1e3:>11.1f} ms")
    if args.json:
        write_json_report(args.json, "data_loader", throughput=throughput, first_batch=first_batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
