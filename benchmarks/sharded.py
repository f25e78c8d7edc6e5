"""ShardedState under a SIGKILL: 4 FSDP2 workers, rank 2 killed mid-step, figures per state size.

    python -m benchmarks.sharded [--sizes 6,100] [--steps 30] [--kill-step 15] [--json PATH]

Per size (model + Adam state, float32) one elastic-run job with --np 4 --min-np 2 and
--shard-replicas 1. Each worker appends one JSON line per event to <dir>/rank<R>.<pid>.jsonl:
its step times, each ``commit()``'s duration beside one ``copy_`` of the same local shards
into a preallocated buffer (the floor any snapshot pays), the bytes the commit sent to its
replica, and around the re-shard the peak RSS before and after. Rank 2 SIGKILLs itself
after training step --kill-step, before committing it, and notes the time first.

Reported: kill -> next completed step on a survivor, and that minus the median step (the
re-run step is not a stall); commit median vs copy_ median (the ratio is the cost of the
commit on the loop, R=1 replication included, as its copies overlap the next step); bytes
per commit per worker; peak RSS growth during the re-shard against the worker's shard.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def width_for(size_mb: float) -> int:
    """Width of the 4 square layers whose parameters + Adam's two states make ``size_mb``."""
    return max(8, int((size_mb * 1e6 / 12 / 4) ** 0.5))


def worker(args) -> None:
    import torch
    import torch.nn as nn

    import elastic

    def rss_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    width = width_for(args.size_mb)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])

    elastic.init()
    state = elastic.ShardedState(model=build, optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-4), step=0)
    log_path = os.path.join(args.dir, f"rank{elastic.rank()}.{os.getpid()}.jsonl")

    def note(**record):
        with open(log_path, "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n")

    before_sync = {"rss": rss_mb()}

    @elastic.run
    def train(state):
        rank, world = elastic.rank(), elastic.size()
        note(event="entered", rank=rank, world=world, rss_before=before_sync["rss"], rss_after=rss_mb(),
             reshard_bytes=state._last_reshard_bytes, shard_mb=state._own.nbytes / 1e6)
        model, opt = state.model, state.optimizer
        x = torch.randn(16, width, generator=torch.Generator().manual_seed(rank))
        while state.step < args.steps:
            started = time.monotonic()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if state.step + 1 == args.kill_step and rank == 2 and not os.path.exists(os.path.join(args.dir, "killed")):
                Path(args.dir, "killed").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            state.step += 1
            trained = time.monotonic()
            # The floor: one copy_ of the same local shards into a buffer kept across steps.
            tensors = [t.to_local() for t in model.parameters()] + [
                v.to_local() for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")]
            if [f.shape for f in state.__dict__.get("floor", [])] != [t.shape for t in tensors]:
                state.__dict__["floor"] = [torch.empty_like(t) for t in tensors]
            copy_started = time.monotonic()
            with torch.no_grad():
                for buffer, tensor in zip(state.__dict__["floor"], tensors):
                    buffer.copy_(tensor)
            copied = time.monotonic()
            state.commit()
            replication = state._replication
            note(event="step", step=state.step, rank=rank, world=world, step_s=trained - started,
                 copy_s=copied - copy_started, commit_s=time.monotonic() - copied,
                 sent=replication.bytes_sent if replication is not None else 0)
            before_sync["rss"] = rss_mb()

    train(state)


def run_size(size_mb: float, args) -> dict:
    directory = tempfile.mkdtemp(prefix=f"sharded-bench-{size_mb:g}mb-")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "elastic.cli", "--np", "4", "--min-np", "2", "--collective-timeout", "60",
               "--shard-replicas", "1", "--log-dir", os.path.join(directory, "logs"), "-m", "benchmarks.sharded",
               "--worker", "--size-mb", str(size_mb), "--steps", str(args.steps), "--kill-step", str(args.kill_step),
               "--dir", directory]
    with open(os.path.join(directory, "elastic-run.txt"), "wb") as out:
        code = subprocess.run(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode
    if code != 0:
        raise SystemExit(f"elastic-run failed ({code}) at {size_mb} MB: see {directory}/elastic-run.txt")
    records = [json.loads(line) for p in Path(directory).glob("rank*.jsonl") for line in p.read_text().splitlines()]
    killed_at = float(Path(directory, "killed").read_text())
    steps = [r for r in records if r["event"] == "step"]
    after = [r["t"] for r in steps if r["t"] > killed_at and r["world"] == 3]
    step_median = statistics.median(r["step_s"] + r["commit_s"] + r["copy_s"] for r in steps if r["world"] == 4)
    next_step = min(after) - killed_at
    commits = [r for r in steps if r["world"] == 4]
    reshard = [r for r in records if r["event"] == "entered" and r["world"] == 3]
    return {
        "size_mb": size_mb,
        "shard_mb": statistics.median(r["shard_mb"] for r in reshard),
        "kill_to_next_step_s": round(next_step, 3),
        "stall_beyond_rerun_s": round(next_step - step_median, 3),
        "step_median_s": round(step_median, 4),
        "commit_median_s": round(statistics.median(r["commit_s"] for r in commits), 4),
        "copy_median_s": round(statistics.median(r["copy_s"] for r in commits), 4),
        "bytes_per_commit": int(statistics.median(r["sent"] for r in commits)),
        "reshard_received_mb": round(max(r["reshard_bytes"] for r in reshard) / 1e6, 3),
        "reshard_peak_rss_growth_mb": round(max(r["rss_after"] - r["rss_before"] for r in reshard), 1),
        "dir": directory,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="6,100", help="state sizes in MB (model + Adam), comma-separated")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=float, default=6.0, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = [run_size(float(size), args) for size in args.sizes.split(",")]
    print("| state | shard/worker | kill -> next step | stall beyond re-run step | commit (R=1) | copy_ | ratio "
          "| bytes sent/commit/worker | re-shard received | peak RSS growth in re-shard |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['size_mb']:g} MB | {r['shard_mb']:.1f} MB | {r['kill_to_next_step_s']:.3f} s "
              f"| {r['stall_beyond_rerun_s']:.3f} s | {r['commit_median_s'] * 1e3:.1f} ms "
              f"| {r['copy_median_s'] * 1e3:.1f} ms | {r['commit_median_s'] / max(r['copy_median_s'], 1e-9):.2f}x "
              f"| {r['bytes_per_commit'] / 1e6:.2f} MB | {r['reshard_received_mb']:.2f} MB "
              f"| {r['reshard_peak_rss_growth_mb']:.0f} MB |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
