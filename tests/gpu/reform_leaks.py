"""T4: does a one-rank NCCL ring leak across re-formations? (gpu review F10)

Each round: a fresh ``/round/<i>/`` store namespace, an eager NCCL group, a DDP forward
and backward on an MLP, then an abort (odd rounds, the failure path) or a destroy (even
rounds, a planned switch), then a collection. Per round it records device memory (free,
reserved), host pinned memory, threads, file descriptors, RSS and the init / leave
times. Growth over the last half of the rounds must stay under the bounds below.

    python -m tests.gpu.reform_leaks --rounds 100 --params 50e6 --json OUT.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from elastic.worker import ring_abort

DEVICE_GROWTH_BYTES = 64 << 20
THREAD_GROWTH = 2
FD_GROWTH = 8


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pinned() -> int:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return stats().get("reserved_bytes.current", 0) if stats else 0


def _mlp(params: float) -> torch.nn.Module:
    width = max(64, int((params / 4) ** 0.5))  # four square layers
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).cuda()


def run(rounds: int, params: float) -> list[dict]:
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "1")
    base = dist.HashStore()
    device = torch.device("cuda", torch.cuda.current_device())
    model = _mlp(params)
    records = []
    for i in range(1, rounds + 1):
        store = dist.PrefixStore(f"/round/{i}/", base)
        before = ring_abort.socket_snapshot()
        t0 = time.monotonic()
        dist.init_process_group("nccl", store=dist.PrefixStore("pg/", store), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60), device_id=device)
        ring = ring_abort.prepare_ring(before=before)
        t1 = time.monotonic()
        ddp = torch.nn.parallel.DistributedDataParallel(model, init_sync=False)
        ddp(torch.randn(8, model[0].in_features, device=device)).sum().backward()
        torch.cuda.synchronize()
        t2 = time.monotonic()
        failed = i % 2 == 1
        if failed:
            ring.abort()
        ring_abort.leave_ring(ring, failed=failed, round_number=i)
        del ddp
        model.zero_grad(set_to_none=True)
        gc.collect()
        t3 = time.monotonic()
        free, total = torch.cuda.mem_get_info()
        records.append({"round": i, "left_by": "abort" if failed else "destroy", "init_s": t1 - t0,
                        "step_s": t2 - t1, "leave_s": t3 - t2, "device_used": total - free,
                        "reserved": torch.cuda.memory_reserved(), "pinned": _pinned(),
                        "threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
                        "rss": _rss()})
    return records


def growth(records: list[dict]) -> dict:
    """Growth of each measure over the last half of the rounds (same kind of leave)."""
    half = records[len(records) // 2:]
    first, last = half[0], half[-1] if half[-1]["left_by"] == half[0]["left_by"] else half[-2]
    return {key: last[key] - first[key] for key in ("device_used", "reserved", "pinned", "threads", "fds", "rss")}


def check(records: list[dict]) -> list[str]:
    grew = growth(records)
    problems = []
    if grew["device_used"] > DEVICE_GROWTH_BYTES:
        problems.append(f"device memory grew {grew['device_used'] / 2**20:.0f} MiB")
    if grew["threads"] > THREAD_GROWTH:
        problems.append(f"threads grew by {grew['threads']}")
    if grew["fds"] > FD_GROWTH:
        problems.append(f"file descriptors grew by {grew['fds']}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("reform_leaks: needs CUDA", file=sys.stderr)
        return 2
    records = run(args.rounds, args.params)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": records, "growth": growth(records)}, f, indent=1)
    problems = check(records)
    mean = lambda key: sum(r[key] for r in records) / len(records)  # noqa: E731
    print(f"{args.rounds} rounds: init {mean('init_s') * 1e3:.1f} ms, leave {mean('leave_s') * 1e3:.1f} ms (mean); "
          f"growth over the last half: {growth(records)}; {'; '.join(problems) or 'flat'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
