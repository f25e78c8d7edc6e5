"""What DDP's initial broadcast costs: ``DDP(model)`` against ``DDP(model, init_sync=False)``.

    python -m benchmarks.ddp_init [--state-mb 6,400,900] [--np 4] [--reps 3] [--json PATH]

A gloo ring of --np processes on loopback wraps the benchmark workload's model, grown
to each state size (benchmarks/workload.py: the ballast is a frozen parameter, which
DDP's initial sync broadcasts like any other), in DDP with and without its initial
sync, alternately. After ``state.sync()`` every copy is already equal, so the
broadcast is pure cost on the path back to training after every re-formation.
Reported: the slowest rank's construction time, median over the reps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.workload import add_ballast, make_model


def _worker(rank: int, world: int, port: int, sizes: list[float], reps: int, queue) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, world_size=world,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    for state_mb in sizes:
        model = make_model(0)
        add_ballast(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state_mb, 0)
        for _ in range(reps):
            for init_sync in (True, False):
                dist.barrier()
                started = time.perf_counter()
                ddp = DDP(model, init_sync=init_sync)
                elapsed = time.perf_counter() - started
                times = [None] * world
                dist.all_gather_object(times, elapsed)
                if rank == 0:
                    queue.put({"state_mb": state_mb, "init_sync": init_sync, "seconds": max(times)})
                del ddp
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", default="6,400,900")
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.state_mb.split(",") if s]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load = os.getloadavg()[0]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(args.np, free_port(), sizes, args.reps, queue), nprocs=args.np,
                       start_method="spawn")
    samples = []
    while not queue.empty():
        samples.append(queue.get())
    rows = []
    print(f"{'state MB':>9} {'DDP(model)':>11} {'init_sync=False':>16} {'saved':>8}   (load {load:.1f})")
    for state_mb in sizes:
        with_sync = statistics.median(s["seconds"] for s in samples if s["state_mb"] == state_mb and s["init_sync"])
        without = statistics.median(s["seconds"] for s in samples if s["state_mb"] == state_mb and not s["init_sync"])
        rows.append({"state_mb": state_mb, "init_sync_s": with_sync, "no_init_sync_s": without,
                     "saved_s": with_sync - without})
        print(f"{state_mb:>9g} {with_sync:>10.3f}s {without:>15.3f}s {with_sync - without:>7.3f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "np": args.np, "reps": args.reps,
                                               "loadavg_1min": load}, indent=2))
    return 0


def free_port() -> int:
    """A free TCP port on loopback (closed again before rank 0's store binds it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
