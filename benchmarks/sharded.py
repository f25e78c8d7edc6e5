"""ShardedState against torchrun + DCP under a SIGKILL: 4 FSDP2 workers, rank 2 killed mid-step, per state size.

    python -m benchmarks.sharded [--sizes 6,1000] [--steps 30] [--kill-step 15]
                                 [--big-steps 16] [--big-kill-step 8] [--big-from-mb 200] [--json PATH]

Per size (model + Adam state, float32; benchmarks/sharded_figures.py) two jobs, one after
the other, on the same model, optimizer, data and kill:

  elastic   elastic-run --np 4 --min-np 2 --shard-replicas 1, ``elastic.ShardedState``
            committing every step; the survivors re-shard from memory onto 3 workers.
  torchrun  torchrun --standalone --nproc-per-node 4 --max-restarts 1, plain FSDP2
            (``fully_shard`` per layer, then the root), ``dcp.save`` of
            ``get_state_dict(model, optimizer)`` after every step; all 4 workers are
            restarted and ``dcp.load`` the newest complete checkpoint
            (benchmarks/sharded_torchrun.py).

Rank 2 SIGKILLs itself after training step --kill-step, before its commit or save, and
notes the time first; both jobs then re-run that step. Each worker appends one JSON line
per event to <dir>/rank<R>.<pid>.jsonl: per step its step time, one ``copy_`` of its local
shards into a buffer kept across steps (the floor any snapshot pays), the snapshot's cost
(``commit()``, or ``dcp.save``) and bytes (sent to the replica, or written), and around the
re-shard or the restore the memory the kernel counts (VmHWM reset at the start).

Reported per size and job: kill -> next completed step, and that minus one median loop
iteration before the kill (step + copy_ + snapshot: the re-run step is not a stall); the
median training step before the kill (forward, backward, optimizer: what the background
replication of elastic's commits competes with); snapshot median vs copy_ median; bytes
per snapshot per worker; bytes received by the re-shard (elastic) or read by the load
(torchrun); the peak memory of the re-shard above what the worker held besides the state
as it began (its RSS less its commit slots and the old model if not yet collected), or of
the restore above the restarted worker's RSS after init_process_group, against the
issue's bound for a re-shard (live shard + snapshot + replicas + one transfer chunk).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

from benchmarks import harness
from benchmarks.recovery import reform_phases
from benchmarks.sharded_figures import (build_model, fmt_ms, memory_bound, memory_verdict, proc_memory_mb,
                                        recovery_figures, reset_peak_memory, steps_for, timeout_for, width_for)

KILLED_RANK, NPROC, REPLICAS = 2, 4, 1
_SYNCS: list[dict] = []  # the elastic worker's syncs: memory and time around each
_OLD_MODEL: list = []  # weak references to the model and optimizer the training function last ran


def old_live_bytes() -> int | None:
    """Bytes of the local shards (parameters, gradients, optimizer states) of the model the
    training function last ran, None once it is freed (weak references: never kept alive)."""
    model, opt = (ref() for ref in _OLD_MODEL) if _OLD_MODEL else (None, None)
    if model is None:
        return None
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    states = opt.state.values() if opt is not None else ()
    tensors += [v for s in states for v in s.values() if hasattr(v, "to_local")]
    return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for t in tensors)


def held_bytes(state) -> int:
    """Bytes of the commit slots a ShardedState holds (own, previous own, replicas, spares)."""
    slots = [getattr(state, "_own", None), *getattr(state, "_own_older", []),
             *getattr(state, "_replicas", {}).values(), *getattr(state, "_spares", {}).values(),
             *getattr(state, "_legacy", [])]
    buffers = {b.data_ptr(): b.numel() * b.element_size() for s in slots if s is not None for b in s.flat.values()}
    return sum(buffers.values())


def worker(args) -> None:
    import torch

    import elastic

    width = width_for(args.size_mb)

    class MeasuredState(elastic.ShardedState):
        def sync(self, ring):
            # The benchmark's copy_ buffer is not the state's: drop it before measuring.
            self.__dict__.pop("floor", None)
            held, old_live = held_bytes(self), old_live_bytes()
            before, started = proc_memory_mb(), time.time()
            reset = reset_peak_memory()
            plan = super().sync(ring)
            after = proc_memory_mb()
            # What the process holds besides the state: its RSS now less the slots it holds
            # and the old ring's model and optimizer, if still alive (dropped, not yet collected).
            _SYNCS.append({"rss_before": before["rss"], "held_mb": (held + (old_live or 0)) / 1e6,
                           "old_model_alive": old_live is not None, "old_live_mb": (old_live or 0) / 1e6,
                           "peak": after["hwm"] if reset else None, "rss_after": after["rss"],
                           "sync_s": time.time() - started})
            return plan

    elastic.init()
    state = MeasuredState(model=lambda: build_model(width),
                          optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-4), step=0)
    log_path = os.path.join(args.dir, f"rank{elastic.rank()}.{os.getpid()}.jsonl")

    def note(**record):
        with open(log_path, "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n")

    @elastic.run
    def train(state):
        rank, world = elastic.rank(), elastic.size()
        book = state._book
        note(event="entered", rank=rank, world=world, sync=_SYNCS[-1], reshard_bytes=book.last_reshard_bytes,
             shard_mb=book.own.nbytes / 1e6, replicas_mb=sum(s.nbytes for s in book.replicas.values()) / 1e6)
        model, opt = state.model, state.optimizer
        _OLD_MODEL[:] = [weakref.ref(model), weakref.ref(opt)]
        x = torch.randn(16, width, generator=torch.Generator().manual_seed(rank))
        while state.step < args.steps:
            started = time.monotonic()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if (state.step + 1 == args.kill_step and rank == KILLED_RANK
                    and not os.path.exists(os.path.join(args.dir, "killed"))):
                Path(args.dir, "killed").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            state.step += 1
            trained = time.monotonic()
            copy_s = copy_floor(state.__dict__, model, opt)
            copied = time.monotonic()
            state.commit()
            replication = state._book.replication
            note(event="step", step=state.step, rank=rank, world=world, step_s=trained - started, copy_s=copy_s,
                 snapshot_s=time.monotonic() - copied, sent=replication.bytes_sent if replication is not None else 0,
                 rss=proc_memory_mb()["rss"])

    train(state)


def copy_floor(holder: dict, model, opt) -> float:
    """Seconds of one ``copy_`` of the local shards (parameters and Adam's states) into a
    buffer kept in ``holder`` across steps: the floor any snapshot pays."""
    import torch

    tensors = [t.to_local() for t in model.parameters()] + [
        v.to_local() for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")]
    if [f.shape for f in holder.get("floor", [])] != [t.shape for t in tensors]:
        holder["floor"] = [torch.empty_like(t) for t in tensors]
    started = time.monotonic()
    with torch.no_grad():
        for buffer, tensor in zip(holder["floor"], tensors):
            buffer.copy_(tensor)
    return time.monotonic() - started


class JobFailed(Exception):
    pass


def launch(command: list[str], env: dict, directory: str, timeout: float, what: str) -> None:
    with harness.Job(command, env, Path(directory, f"{what}.txt")) as job:
        code = job.wait(timeout)
    if code != 0:
        raise JobFailed(f"{what} {'timed out' if code is None else f'failed ({code})'}: see {directory}/{what}.txt")


def read_records(directory: str) -> tuple[list[dict], float]:
    records = [json.loads(line) for p in Path(directory).glob("rank*.jsonl") for line in p.read_text().splitlines()]
    return records, float(Path(directory, "killed").read_text())


def run_elastic(size_mb: float, steps: int, kill_step: int) -> dict:
    directory = tempfile.mkdtemp(prefix=f"sharded-bench-{size_mb:g}mb-elastic-")
    command = [sys.executable, "-m", "elastic.cli", "--np", str(NPROC), "--min-np", "2", "--collective-timeout", "60",
               "--shard-replicas", str(REPLICAS), "--log-dir", os.path.join(directory, "logs"),
               "-m", "benchmarks.sharded", "--worker", "--size-mb", str(size_mb), "--steps", str(steps),
               "--kill-step", str(kill_step), "--dir", directory]
    launch(command, harness.benchmark_env(), directory, timeout_for(size_mb, steps), "elastic-run")
    records, killed_at = read_records(directory)
    steps_before = [r for r in records if r["event"] == "step" and r["world"] == NPROC]
    after = [r for r in records if r["event"] == "step" and r["world"] == NPROC - 1]
    reshard = [r for r in records if r["event"] == "entered" and r["world"] == NPROC - 1]
    # The survivors keep their order: the new ranks are the old ones without the killed rank.
    bounds = memory_bound(width_for(size_mb), NPROC, [KILLED_RANK], REPLICAS)
    # Above what the process held besides the state when the re-shard began.
    peaks = {r["rank"]: r["sync"]["peak"] - (r["sync"]["rss_before"] - r["sync"]["held_mb"])
             for r in reshard if r["sync"]["peak"] is not None}
    old_ranks = {r["pid"]: r["rank"] for r in steps_before}
    return {
        "variant": "elastic", "size_mb": size_mb, "steps": steps, "kill_step": kill_step,
        "shard_mb": statistics.median(r["shard_mb"] for r in reshard),
        **recovery_figures(steps_before, after, killed_at),
        "kill_to_sync_done_s": round(min(r["t"] for r in reshard) - killed_at, 3),
        "sync_s": round(max(r["sync"]["sync_s"] for r in reshard), 3),
        "bytes_per_snapshot": int(statistics.median(r["sent"] for r in steps_before)),
        "received_mb": round(max(r["reshard_bytes"] for r in reshard) / 1e6, 3),
        "steady_rss_mb": round(max(r["rss"] for r in steps_before), 1),
        "reshard_rss_growth_mb": round(max(r["sync"]["rss_after"] - r["sync"]["rss_before"] for r in reshard), 1),
        "held_at_reshard_start_mb": {r["rank"]: round(r["sync"]["held_mb"], 1) for r in reshard},
        "old_model_alive_at_reshard": any(r["sync"]["old_model_alive"] for r in reshard),
        "old_live_at_reshard_start_mb": max(r["sync"]["old_live_mb"] for r in reshard),
        "new_rank_of_old": {old_ranks.get(r["pid"]): r["rank"] for r in reshard},
        "phases": reform_phases(Path(directory, "logs", "events.jsonl"), killed_at),
        "replicas_mb": max(r["replicas_mb"] for r in reshard),
        "memory": memory_verdict(peaks, bounds) if peaks else None,
        "dir": directory,
    }


def run_size(size_mb: float, args) -> list[dict]:
    from benchmarks import sharded_torchrun

    steps, kill_step = steps_for(size_mb, args.steps, args.kill_step, args.big_steps, args.big_kill_step,
                                 args.big_from_mb)
    rows = []
    for name, run in (("elastic", run_elastic), ("torchrun", sharded_torchrun.run)):
        load = os.getloadavg()[0]
        started = time.monotonic()
        try:
            row = run(size_mb, steps, kill_step)
        except (JobFailed, OSError, ValueError, KeyError) as exc:  # the other job and sizes still run
            row = {"variant": name, "size_mb": size_mb, "steps": steps, "kill_step": kill_step, "error": str(exc)}
        row.update(loadavg_1min=round(load, 2), wall_s=round(time.monotonic() - started, 1))
        outcome = row.get("error") or f"kill -> next step {row['kill_to_next_step_s']:.3f} s"
        print(f"{size_mb:g} MB {name}: {outcome} (load {load:.1f}, {row['wall_s']:.0f} s)", flush=True)
        rows.append(row)
    return rows


def _mb(value: float) -> str:
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def print_table(rows: list[dict]) -> None:
    print("| state | job | shard/worker | kill -> next step | stall beyond re-run step | train step "
          "| snapshot per step | copy_ | ratio | bytes per snapshot/worker | re-shard received / load read "
          "| peak memory in re-shard / restore | bound (live + snapshot + replicas + chunk) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("error"):
            print(f"| {r['size_mb']:g} MB | {r['variant']} | {r['error']} |" + " |" * 11)
            continue
        memory, snapshot = r["memory"], ("commit (R=1)" if r["variant"] == "elastic" else "dcp.save")
        peak = f"{_mb(memory['peak_mb'])} MB" if memory else "-"
        if r["variant"] == "elastic" and memory:
            parts = memory["bound_parts_mb"]
            bound = (f"{_mb(memory['bound_mb'])} MB ({_mb(parts['live'])} + {_mb(parts['snapshot'])} + "
                     f"{_mb(parts['replicas'])} + {parts['chunk']:.2f}): {'met' if memory['met'] else 'NOT met'}")
        else:
            bound = "-"
        sent = "sent" if r["variant"] == "elastic" else "written"
        print(f"| {r['size_mb']:g} MB | {r['variant']} | {r['shard_mb']:.1f} MB | {r['kill_to_next_step_s']:.3f} s "
              f"| {r['stall_beyond_rerun_s']:.3f} s | {r['train_median_s']:.3f} s "
              f"| {snapshot} {fmt_ms(r['snapshot_median_s'])} | {fmt_ms(r['copy_median_s'])} "
              f"| {r['snapshot_median_s'] / max(r['copy_median_s'], 1e-9):.2f}x "
              f"| {r['bytes_per_snapshot'] / 1e6:.2f} MB {sent} | {r['received_mb']:.2f} MB | {peak} | {bound} "
              f"| {r['loadavg_1min']:.1f} |")


def print_goals(rows: list[dict]) -> None:
    """The issue's goals, per size, for the elastic job (the torchrun rows are the baseline)."""
    for r in rows:
        if r["variant"] != "elastic" or r.get("error"):
            continue
        base = next((b for b in rows if b["variant"] == "torchrun" and b["size_mb"] == r["size_mb"]
                     and not b.get("error")), None)
        ratio = r["snapshot_median_s"] / max(r["copy_median_s"], 1e-9)
        against = "" if base is None else f"; torchrun + DCP: {base['stall_beyond_rerun_s']:.3f} s"
        memory = r["memory"] or {}
        stall_goal = (f"goal <= 1.0 s: {'met' if r['stall_beyond_rerun_s'] <= 1.0 else 'not met'}"
                      if r["size_mb"] >= 1000 else "the 1.0 s goal is for 1 GB")
        print(f"{r['size_mb']:g} MB: stall beyond re-run step {r['stall_beyond_rerun_s']:.3f} s "
              f"({stall_goal}{against}); "
              f"commit {ratio:.2f}x copy_ (goal <= 1.5x: {'met' if ratio <= 1.5 else 'not met'}); "
              f"re-shard peak {memory.get('peak_mb', '-')} MB vs bound {memory.get('bound_mb', '-')} MB "
              f"(worst rank {memory.get('rank', '-')}: {'met' if memory.get('met') else 'not met'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="6,1000", help="state sizes in MB (model + Adam), comma-separated")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=15)
    parser.add_argument("--big-steps", type=int, default=16, help="--steps for sizes >= --big-from-mb")
    parser.add_argument("--big-kill-step", type=int, default=8, help="--kill-step for sizes >= --big-from-mb")
    parser.add_argument("--big-from-mb", type=float, default=200)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=float, default=6.0, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    load_before = os.getloadavg()
    rows = [row for size in args.sizes.split(",") for row in run_size(float(size), args)]
    print_table(rows)
    print_goals(rows)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}; "
          f"after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "loadavg_before": load_before,
                                               "loadavg_after": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
