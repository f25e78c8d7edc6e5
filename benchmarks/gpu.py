"""The GPU path's costs: the commit's stall on the training loop, the re-formation of a
one-rank NCCL group, and device memory across re-formations (gpu review F6, F10).

    python -m benchmarks.gpu [--state-mb 512] [--steps 20] [--rounds 100] [--json PATH]

* commit stall: a loop of device-bound steps (matmuls on a state of --state-mb), with a
  commit (``Snapshot.capture``: double-buffered, side stream, registered pinned memory)
  after every step, against the same loop without commits; reported against one
  synchronous device-to-host ``copy_`` of the state (goal: the loop waits <= 10% of it).
  The host time inside ``capture`` is reported too (the host's own stall).
* re-formation: ``tests/gpu/reform_leaks.py``'s rounds (eager init, DDP step, abort or
  destroy): mean init and leave times, and growth of device memory over the last half.

Without CUDA only the CPU part runs (capture of a CPU state against one ``copy_``), and
the output says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from elastic.checkpoint import Snapshot


def _state(mb: int, device: str) -> dict:
    n = mb * (1 << 20) // 4 // 8
    return {f"w{i}": torch.randn(n, device=device) for i in range(8)}


def cpu_part(mb: int, reps: int = 5) -> dict:
    state = _state(mb, "cpu")
    targets = {k: torch.empty_like(v) for k, v in state.items()}
    snapshot = Snapshot()
    snapshot.capture(state)  # allocation
    copies, captures = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch._foreach_copy_(list(targets.values()), list(state.values()))
        t1 = time.perf_counter()
        snapshot.capture(state)
        t2 = time.perf_counter()
        copies.append(t1 - t0)
        captures.append(t2 - t1)
    return {"state_mb": mb, "copy_s": statistics.median(copies), "capture_s": statistics.median(captures)}


def _loop(state: dict, steps: int, snapshot) -> tuple[float, float]:
    """(seconds for ``steps`` device-bound steps, host seconds inside capture)."""
    side = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    in_capture = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        for _ in range(20):
            side = torch.tanh(side @ side)  # the step's compute
        for value in state.values():
            value.mul_(0.999)  # the optimizer's in-place writes
        if snapshot is not None:
            c0 = time.perf_counter()
            snapshot.capture(state)
            in_capture += time.perf_counter() - c0
    torch.cuda.synchronize()
    return time.perf_counter() - t0, in_capture


def gpu_part(mb: int, steps: int) -> dict:
    state = _state(mb, "cuda")
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k, v in state.items():
        host[k].copy_(v)
    torch.cuda.synchronize()
    one_copy = time.perf_counter() - t0
    snapshot = Snapshot()
    snapshot.capture(state)
    snapshot.tree()
    _loop(state, 2, None)  # warm-up
    plain, _ = _loop(state, steps, None)
    committed, in_capture = _loop(state, steps, snapshot)
    stall = (committed - plain) / steps
    return {"state_mb": mb, "steps": steps, "copy_s": one_copy, "step_s": plain / steps,
            "stall_per_commit_s": stall, "host_in_capture_s": in_capture / steps,
            "stall_vs_copy": stall / one_copy}


def reform_part(rounds: int) -> dict:
    from tests.gpu import reform_leaks

    records = reform_leaks.run(rounds, 50e6)
    return {"rounds": rounds, "init_ms": 1e3 * statistics.mean(r["init_s"] for r in records),
            "leave_abort_ms": 1e3 * statistics.mean(r["leave_s"] for r in records if r["left_by"] == "abort"),
            "leave_destroy_ms": 1e3 * statistics.mean(r["leave_s"] for r in records if r["left_by"] == "destroy"),
            "growth_last_half": reform_leaks.growth(records), "problems": reform_leaks.check(records)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = {"cpu": cpu_part(args.state_mb)}
    cpu = results["cpu"]
    print(f"CPU: capture of {cpu['state_mb']} MB {cpu['capture_s'] * 1e3:.1f} ms against one copy_ "
          f"{cpu['copy_s'] * 1e3:.1f} ms ({cpu['capture_s'] / cpu['copy_s']:.2f}x)")
    if not torch.cuda.is_available():
        print("GPU part not run: no CUDA here (a CPU build of torch, or no GPU)")
    else:
        results["gpu"] = gpu = gpu_part(args.state_mb, args.steps)
        print(f"GPU ({torch.cuda.get_device_name()}): one device-to-host copy_ of {gpu['state_mb']} MB "
              f"{gpu['copy_s'] * 1e3:.1f} ms; step {gpu['step_s'] * 1e3:.1f} ms; loop stall per commit "
              f"{gpu['stall_per_commit_s'] * 1e3:.1f} ms ({gpu['stall_vs_copy']:.0%} of the copy), host time in "
              f"capture {gpu['host_in_capture_s'] * 1e3:.2f} ms")
        results["reform"] = reform = reform_part(args.rounds)
        print(f"NCCL one-rank re-formation x{reform['rounds']}: init {reform['init_ms']:.1f} ms, abort+leave "
              f"{reform['leave_abort_ms']:.1f} ms, destroy {reform['leave_destroy_ms']:.1f} ms; growth over the "
              f"last half {reform['growth_last_half']}; {'; '.join(reform['problems']) or 'flat'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
