"""The GPU path's costs: the commit's stall on the training loop, the re-formation of a
one-rank NCCL group, and device memory across re-formations (gpu review F6, F10).

    python -m benchmarks.gpu [--state-mb 512] [--steps 20] [--rounds 100] [--json PATH]

* commit stall: a loop of device-bound steps (--matmuls matmuls, then the "optimizer's"
  in-place writes to a state of --state-mb), with a commit after every step, against the
  same loop without commits; the stall the training stream sees per commit, reported
  against one synchronous device-to-host ``copy_`` of the same bytes (goal: <= 10% of it).
  Two commits (gpu review G13):
  - "drain": what a commit costs by default on an NCCL ring: the ring check's sync of the
    training stream (``check_ring``), then ``Snapshot.capture`` (double-buffered, side
    stream, registered pinned memory), whose copy the training stream waits for;
  - "overlap": ``ELASTIC_OVERLAP_COMMIT=1`` (checkpoint/device_snapshot.py): no sync, the
    copy overlaps the next step, whose in-place writes wait for it (the optimizer step's
    pre-hook). It can hide the copy only where a step lasts longer than the copy: the
    step and the copy are reported next to it.
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


def _loop(state: dict, steps: int, snapshot, matmuls: int = 20, drain: bool = False) -> tuple[float, float]:
    """(seconds for ``steps`` device-bound steps, host seconds inside the commits).
    ``drain``: each commit first syncs the training stream, as the ring check does."""
    side = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    overlap = getattr(snapshot, "overlap", None)
    in_capture = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        for _ in range(matmuls):
            side = torch.tanh(side @ side)  # the step's compute
        if overlap is not None:  # what the optimizer's step pre-hook does (device_snapshot.install)
            overlap.settle_if_done()
            overlap.gate.before_write()
        for value in state.values():
            value.mul_(0.999)  # the optimizer's in-place writes
        if snapshot is not None:
            c0 = time.perf_counter()
            if drain:
                torch.cuda.current_stream().synchronize()  # check_ring(device_sync=True)
            snapshot.capture(state)
            in_capture += time.perf_counter() - c0
    torch.cuda.synchronize()
    return time.perf_counter() - t0, in_capture


def _overlapped_snapshot(state: dict) -> Snapshot:
    from elastic.checkpoint.device_snapshot import OverlappedCopy

    snapshot = Snapshot()
    snapshot.overlap = OverlappedCopy()
    snapshot.overlap.guarded = frozenset(v.data_ptr() for v in state.values())  # the "optimizer" writes them
    return snapshot


def gpu_part(mb: int, steps: int, matmuls: int = 20) -> dict:
    state = _state(mb, "cuda")
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k, v in state.items():
        host[k].copy_(v)
    torch.cuda.synchronize()
    one_copy = time.perf_counter() - t0
    result = {"state_mb": mb, "steps": steps, "matmuls": matmuls, "copy_s": one_copy}
    _loop(state, 2, None, matmuls)  # warm-up
    plain, _ = _loop(state, steps, None, matmuls)
    result["step_s"] = plain / steps
    for name, snapshot, drain in (("drain", Snapshot(), True), ("overlap", _overlapped_snapshot(state), False)):
        snapshot.capture(state)  # allocation, registration
        snapshot.tree()
        committed, in_capture = _loop(state, steps, snapshot, matmuls, drain)
        stall = (committed - plain) / steps
        result[name] = {"stall_per_commit_s": stall, "host_in_commit_s": in_capture / steps,
                        "stall_vs_copy": stall / one_copy}
    # The figures earlier runs reported under these names: the default (draining) commit's.
    result.update(stall_per_commit_s=result["drain"]["stall_per_commit_s"],
                  stall_vs_copy=result["drain"]["stall_vs_copy"])
    return result


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
    parser.add_argument("--matmuls", type=int, default=80, help="2048x2048 matmuls per step (its length)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = {"cpu": cpu_part(args.state_mb)}
    cpu = results["cpu"]
    print(f"CPU: capture of {cpu['state_mb']} MB {cpu['capture_s'] * 1e3:.1f} ms against one copy_ "
          f"{cpu['copy_s'] * 1e3:.1f} ms ({cpu['capture_s'] / cpu['copy_s']:.2f}x)")
    if not torch.cuda.is_available():
        print("GPU part not run: no CUDA here (a CPU build of torch, or no GPU)")
    else:
        results["gpu"] = gpu = gpu_part(args.state_mb, args.steps, args.matmuls)
        print(f"GPU ({torch.cuda.get_device_name()}): one device-to-host copy_ of {gpu['state_mb']} MB "
              f"{gpu['copy_s'] * 1e3:.1f} ms; step {gpu['step_s'] * 1e3:.1f} ms")
        for name in ("drain", "overlap"):
            fig = gpu[name]
            print(f"  commit ({name}): training stream stall {fig['stall_per_commit_s'] * 1e3:.1f} ms per commit "
                  f"({fig['stall_vs_copy']:.0%} of the copy), host time in the commit "
                  f"{fig['host_in_commit_s'] * 1e3:.2f} ms")
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
