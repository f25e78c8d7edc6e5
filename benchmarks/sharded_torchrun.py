"""The baseline of benchmarks/sharded.py: what a torchrun user has today for an FSDP2 job.

    torchrun --standalone --nproc-per-node 4 --max-restarts 1 -m benchmarks.sharded_torchrun \
        --size-mb 6 --steps 30 --kill-step 15 --dir D

Each worker: gloo, the model of benchmarks/sharded_figures.py, ``fully_shard`` per layer
then the root (ShardedState's default), Adam. After every step it saves
``get_state_dict(model, optimizer)`` with ``torch.distributed.checkpoint.save`` to
D/ckpt/<step> (rank 0 then drops all but the last two), so the kill loses one step, as
with elastic-run. At a start it loads the newest complete checkpoint (one with DCP's
``.metadata``, written last): the model is built on the meta device, sharded, given
empty storage and filled by ``dcp.load`` (no initialisation of the whole model, the
cheapest restart for the user); without one, every rank builds the whole model from the
seed and shards it. Rank 2 SIGKILLs itself after training step --kill-step of the first
incarnation, before saving it; torchrun stops the other three and restarts all four.

Records (one JSON line per event, <dir>/rank<R>.<pid>.jsonl) are those of the elastic
worker of benchmarks/sharded.py: "entered" once the state is loaded (with the memory
around the load), "step" per step with ``snapshot_s`` the save's duration.
"""

from __future__ import annotations

import time

_STARTED = time.time()  # the process's start (before torch is imported): a restart's first moment

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.sharded_figures import (fsdp_from_newest, newest_checkpoint, proc_memory_mb,  # noqa: E402
                                        recovery_figures, reset_peak_memory, timeout_for, width_for)

KILLED_RANK, NPROC = 2, 4
KEEP = 2  # checkpoints kept: the newest complete one survives a save that a kill interrupts


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.sharded import copy_floor

    imported = time.time()
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    grouped = time.time()
    world = dist.get_world_size()
    runtime_rss = proc_memory_mb()["rss"]
    reset = reset_peak_memory()
    width, root = width_for(args.size_mb), Path(args.dir, "ckpt")
    log_path = os.path.join(args.dir, f"rank{rank}.{os.getpid()}.jsonl")

    def note(**record):
        with open(log_path, "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "rank": rank, "world": world,
                                "restart": restart, **record}) + "\n")

    began = time.time()
    newest = newest_checkpoint(root)
    mesh = init_device_mesh("cpu", (world,))
    model, opt, step = fsdp_from_newest(width, mesh, newest)
    memory = proc_memory_mb()
    local = [t.to_local() for t in model.parameters()] + [
        v.to_local() for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")]
    note(event="entered", import_s=imported - _STARTED, pg_init_s=grouped - imported, load_s=time.time() - began,
         started=_STARTED, resumed_from=step, runtime_rss=runtime_rss,
         peak=memory["hwm"] if reset else None, rss=memory["rss"],
         shard_mb=sum(t.numel() * t.element_size() for t in local) / 1e6)
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(rank))
    holder: dict = {}
    while step < args.steps:
        started = time.monotonic()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step + 1 == args.kill_step and rank == KILLED_RANK and restart == 0:
            Path(args.dir, "killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        step += 1
        trained = time.monotonic()
        copy_s = copy_floor(holder, model, opt)
        copied = time.monotonic()
        model_state, optim_state = get_state_dict(model, opt)
        path = root / f"{step:06d}"
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
        saved = time.monotonic()
        if rank == 0:
            done = sorted((p for p in root.glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
            for old in done[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)
        note(event="step", step=step, step_s=trained - started, copy_s=copy_s, snapshot_s=saved - copied,
             sent=sum(p.stat().st_size for p in path.glob(f"__{rank}_*")), rss=proc_memory_mb()["rss"])
    dist.destroy_process_group()


def run(size_mb: float, steps: int, kill_step: int) -> dict:
    """One torchrun job at ``size_mb``; the figures of benchmarks/sharded.py's torchrun row."""
    from benchmarks import harness
    from benchmarks.sharded import launch, read_records

    directory = tempfile.mkdtemp(prefix=f"sharded-bench-{size_mb:g}mb-torchrun-")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
               "--max-restarts", "1", "-m", "benchmarks.sharded_torchrun", "--size-mb", str(size_mb),
               "--steps", str(steps), "--kill-step", str(kill_step), "--dir", directory]
    # The workaround of pytorch issue 135712 (a restart reusing the agent's store may never
    # re-connect): without it torchrun often does not recover at all (BENCHMARKS.md, recovery).
    env = harness.benchmark_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    try:
        launch(command, env, directory, timeout_for(size_mb, steps), "torchrun")
        records, killed_at = read_records(directory)
    finally:
        shutil.rmtree(Path(directory, "ckpt"), ignore_errors=True)  # up to 2 GB at 1 GB of state
    steps_before = [r for r in records if r["event"] == "step" and r["restart"] == 0]
    after = [r for r in records if r["event"] == "step" and r["restart"] > 0]
    restored = [r for r in records if r["event"] == "entered" and r["restart"] > 0]
    peaks = [r["peak"] - r["runtime_rss"] for r in restored if r["peak"] is not None]
    return {
        "variant": "torchrun", "size_mb": size_mb, "steps": steps, "kill_step": kill_step,
        "shard_mb": statistics.median(r["shard_mb"] for r in restored),
        **recovery_figures(steps_before, after, killed_at),
        "kill_to_restart_s": round(min(r["started"] for r in restored) - killed_at, 3),
        "kill_to_loaded_s": round(min(r["t"] for r in restored) - killed_at, 3),
        # The slowest restarted worker's phases: python + imports, process group, build + load.
        "phases": {phase: round(max(r[phase] for r in restored), 3) for phase in ("import_s", "pg_init_s", "load_s")},
        "resumed_from_checkpoint": min(r["resumed_from"] for r in restored),
        "bytes_per_snapshot": int(statistics.median(r["sent"] for r in steps_before)),
        "received_mb": round(max(r["shard_mb"] for r in restored), 3),
        "steady_rss_mb": round(max(r["rss"] for r in steps_before), 1),
        "memory": {"peak_mb": round(max(peaks), 1)} if peaks else None,
        "dir": directory,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-step", type=int, required=True)
    parser.add_argument("--dir", required=True)
    worker(parser.parse_args())


if __name__ == "__main__":
    main()
