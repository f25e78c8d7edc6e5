"""Hybrid sharding (HSDP) against torchrun + DCP: a host lost and a group refilled, 2 replicas x 2 shards.

    python -m benchmarks.hybrid [--size-mb 1000] [--steps 14] [--kill-step 5] [--json PATH]

One state size (model + Adam state, float32; benchmarks/sharded_figures.py), two jobs in
one run, one after the other, on the same model, optimizer and data, each on a mesh of
2 replica groups x 2 shards (FSDP2's ``fully_shard`` per layer then the root, on a
("replicate", "shard") mesh):

  elastic   two agents (host a, host b) of 2 workers on one etcd, ``elastic.HybridShardedState``
            (shard_size=2, min_groups=1) committing every step. After step --kill-step a
            worker of host b SIGKILLs its agent and itself: host b is lost, host a's
            group goes on alone (nothing moves). Once host a has trained 2 steps alone
            (it then commits without training until the mesh is whole), host b's agent starts again: its 2 workers join and, at a commit, take
            their shards from host a's group over the ring (a refill), and the 2 x 2
            mesh trains on.
  torchrun  torchrun --standalone --nproc-per-node 4 --max-restarts 1, the same mesh
            (``init_device_mesh("cpu", (2, 2), ("replicate", "shard"))``), ``dcp.save``
            after every step; ranks 2 and 3 (a "host") SIGKILL themselves after step
            --kill-step: torchrun restarts all 4, which ``dcp.load`` the newest
            checkpoint. Its host loss and its refill are the one restart.

Reported: host loss -> training again (the survivors re-entered their training
function: detection, the new ring, the mesh and the restore) and -> the next completed
step; the refill: the bytes moved to the new group, the receivers' sync time, seconds
per GB moved, and host a's stall (from its last step before the switch to its first
step after, less one step); torchrun: kill -> restarted workers training again, and ->
the next completed step. Workers write one JSON line per event to <dir>/rank<R>.<pid>.jsonl.
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
from pathlib import Path

from benchmarks import harness
from benchmarks.sharded_figures import build_model, fsdp_from_newest, newest_checkpoint, timeout_for, width_for

NPROC = 2  # per host


def note(directory: str, **record) -> None:
    with open(os.path.join(directory, f"rank{record.get('rank', 'x')}.{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n")


def elastic_worker(args) -> None:
    import torch

    import elastic

    width = width_for(args.size_mb)
    syncs: list[dict] = []

    class MeasuredState(elastic.HybridShardedState):
        def sync(self, ring):
            started = time.time()
            plan = super().sync(ring)
            syncs.append({"started": started, "sync_s": time.time() - started, **self._hybrid.last})
            return plan

    elastic.init()
    state = MeasuredState(model=lambda: build_model(width), optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-4),
                          shard_size=2, min_groups=1, step=0)

    @elastic.run
    def train(state):
        rank, world = elastic.rank(), elastic.size()
        index, count = state.data_share
        note(args.dir, event="entered", rank=rank, world=world, host=os.environ.get("BENCH_HOST"),
             sync=syncs[-1] if syncs else None, mesh=state.mesh_plan.describe())
        model, opt = state.model, state.optimizer
        x = torch.randn(16, width, generator=torch.Generator().manual_seed(index))
        while state.step < args.steps:
            if world < 2 * NPROC and (state.step == 0 or state.step >= args.kill_step + 2):
                time.sleep(0.2)  # until both hosts are in, and host a has trained 2 steps alone
                model(x[:0]).sum().backward()
                opt.zero_grad()
                state.commit()
                note(args.dir, event="held", rank=rank, world=world, step=state.step, host=os.environ.get("BENCH_HOST"))
                continue
            started = time.monotonic()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if (state.step + 1 == args.kill_step and os.environ.get("BENCH_HOST") == "b"
                    and not os.path.exists(os.path.join(args.dir, "killed"))):
                Path(args.dir, "killed").write_text(str(time.time()))
                os.kill(int(os.environ["ELASTIC_WORKER_AGENT_PID"]), signal.SIGKILL)  # the agent (not our parent: a template): host b is gone
                os.kill(os.getpid(), signal.SIGKILL)
            state.step += 1
            trained = time.monotonic()
            state.commit()
            note(args.dir, event="step", rank=rank, world=world, step=state.step, host=os.environ.get("BENCH_HOST"),
                 step_s=trained - started, commit_s=time.monotonic() - trained)

    train(state)


def run_elastic(args) -> dict:
    from elastic.rendezvous import EmbeddedEtcd

    directory = tempfile.mkdtemp(prefix=f"hybrid-bench-{args.size_mb:g}mb-elastic-")
    timeout = timeout_for(args.size_mb, args.steps)
    with EmbeddedEtcd() as etcd:
        def agent(host: str) -> harness.Job:
            command = [sys.executable, "-m", "elastic.cli", "--rdzv-endpoint", etcd.endpoint, "--job-id",
                       "hybrid-bench", "--host-id", f"host-{host}", "--host-addr", "127.0.0.1", "--nproc-per-node",
                       str(NPROC), "--min-np", "2", "--max-np", "4", "--collective-timeout", "120",
                       "--log-dir", os.path.join(directory, f"logs-{host}"), "-m", "benchmarks.hybrid",
                       "--elastic-worker", "--size-mb", str(args.size_mb), "--steps", str(args.steps),
                       "--kill-step", str(args.kill_step), "--dir", directory]
            return harness.Job(command, harness.benchmark_env(BENCH_HOST=host),
                               Path(directory, f"elastic-{host}-{time.time():.0f}.txt"))

        jobs = [agent("a")]
        a = jobs[0]
        try:
            harness.wait_for(lambda: list(Path(directory).glob("rank*.jsonl")) or not a.running(), 300)
            jobs.append(agent("b"))
            harness.wait_for(lambda: Path(directory, "killed").exists() or not a.running(), timeout)
            jobs[-1].wait(60)
            killed_at = float(Path(directory, "killed").read_text())
            # Host b comes back once host a trained two steps alone (it holds after them).
            harness.wait_for(lambda: len([r for r in records(directory) if r["event"] == "step"
                                          and r["world"] == NPROC and r["t"] > killed_at]) >= 2 * NPROC
                             or not a.running(), timeout)
            jobs.append(agent("b"))
            code = a.wait(timeout)
            jobs[-1].wait(120)
        finally:
            for job in jobs:
                job.stop()
    if code != 0:
        raise RuntimeError(f"elastic-run failed ({code}): see {directory}")
    events = [json.loads(line) for line in Path(directory, "logs-a", "events.jsonl").read_text().splitlines()]
    detected = [e["time"] for e in events if e["event"] == "failure_detected" and e["time"] > killed_at]
    return elastic_figures(records(directory), killed_at, min(detected) if detected else None) | {"dir": directory}


def records(directory: str) -> list[dict]:
    found = []
    for path in Path(directory).glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:  # a line being written
                pass
    return found


def elastic_figures(recs: list[dict], killed_at: float, detected_at: float | None = None) -> dict:
    """The figures of the elastic run (a pure function of its records). ``detected_at``: the
    survivors' first failure_detected: on CPUs a step's computation cannot be interrupted,
    so the loss is seen at the step's next collective, up to a step after the kill."""
    steps = sorted((r for r in recs if r["event"] == "step"), key=lambda r: r["t"])
    entered = sorted((r for r in recs if r["event"] == "entered"), key=lambda r: r["t"])
    before = [r for r in steps if r["world"] == 2 * NPROC and r["t"] < killed_at]
    alone = [r for r in steps if r["world"] == NPROC and r["t"] > killed_at]
    after_loss = [r for r in entered if r["world"] == NPROC and r["t"] > killed_at]
    refilled = [r for r in entered if r["world"] == 2 * NPROC and r["t"] > killed_at]
    again = [r for r in steps if r["world"] == 2 * NPROC and refilled and r["t"] > min(e["t"] for e in refilled)]
    loop = statistics.median(r["step_s"] + r["commit_s"] for r in before)
    receivers = [r for r in refilled if r["host"] == "b"]
    moved = sum(r["sync"]["moved"] for r in receivers)
    refill_s = max(r["sync"]["sync_s"] for r in receivers)
    host_a = [r for r in refilled if r["host"] == "a"]
    held = [r for r in recs if r["event"] == "held" and r["t"] > killed_at and r["world"] == NPROC]
    switch_at = max(r["t"] for r in alone + held)  # host a's last commit alone: the switch's
    first_again = min(r["t"] for r in again if r["host"] == "a")
    return {
        "variant": "elastic", "train_loop_s": round(loop, 3),
        "loss_to_training_s": round(min(r["t"] for r in after_loss) - killed_at, 3),
        "loss_to_next_step_s": round(min(r["t"] for r in alone) - killed_at, 3),
        "loss_sync_s": round(max(r["sync"]["sync_s"] for r in after_loss), 3),
        "loss_detected_s": round(detected_at - killed_at, 3) if detected_at is not None else None,
        "loss_detected_to_training_s": round(min(r["t"] for r in after_loss) - detected_at, 3)
        if detected_at is not None else None,
        "loss_moved_mb": round(sum(r["sync"]["moved"] for r in after_loss) / 1e6, 3),
        "loss_mesh": after_loss[0]["mesh"],
        "refill_moved_mb": round(moved / 1e6, 1), "refill_sync_s": round(refill_s, 3),
        "refill_s_per_gb": round(refill_s / max(moved / 1e9, 1e-9), 3),
        "refill_host_a_sync_s": round(max(r["sync"]["sync_s"] for r in host_a), 3),
        "refill_host_a_stall_s": round(first_again - switch_at - statistics.median(
            r["step_s"] + r["commit_s"] for r in again if r["host"] == "a"), 3),
        "refill_mesh": receivers[0]["mesh"],
    }


def torchrun_worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    world, width, root = dist.get_world_size(), width_for(args.size_mb), Path(args.dir, "ckpt")
    newest = newest_checkpoint(root)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model, opt, step = fsdp_from_newest(width, mesh, newest)
    note(args.dir, event="entered", rank=rank, world=world, restart=restart)
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(rank))
    while step < args.steps:
        started = time.monotonic()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step + 1 == args.kill_step and rank >= world // 2 and restart == 0:
            if rank == world // 2:
                Path(args.dir, "killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        step += 1
        trained = time.monotonic()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"{step:06d}"))
        note(args.dir, event="step", rank=rank, world=world, restart=restart, step=step,
             step_s=trained - started, commit_s=time.monotonic() - trained)
        if rank == 0:
            for old in sorted((p for p in root.glob("*") if p.name.isdigit()), key=lambda p: int(p.name))[:-2]:
                import shutil

                shutil.rmtree(old, ignore_errors=True)
    dist.destroy_process_group()


def run_torchrun(args) -> dict:
    import shutil

    directory = tempfile.mkdtemp(prefix=f"hybrid-bench-{args.size_mb:g}mb-torchrun-")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(2 * NPROC),
               "--max-restarts", "1", "-m", "benchmarks.hybrid", "--torchrun-worker", "--size-mb", str(args.size_mb),
               "--steps", str(args.steps), "--kill-step", str(args.kill_step), "--dir", directory]
    env = harness.benchmark_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # pytorch issue 135712's workaround
    try:
        with harness.Job(command, env, Path(directory, "torchrun.txt")) as job:
            code = job.wait(timeout_for(args.size_mb, args.steps))
    finally:
        shutil.rmtree(Path(directory, "ckpt"), ignore_errors=True)
    if code != 0:
        raise RuntimeError(f"torchrun failed ({code}): see {directory}")
    recs = records(directory)
    killed_at = float(Path(directory, "killed").read_text())
    before = [r for r in recs if r["event"] == "step" and r["restart"] == 0]
    restarted = [r for r in recs if r["event"] == "entered" and r["restart"] > 0]
    after = [r for r in recs if r["event"] == "step" and r["restart"] > 0]
    return {"variant": "torchrun", "train_loop_s": round(statistics.median(r["step_s"] for r in before), 3),
            "dcp_save_s": round(statistics.median(r["commit_s"] for r in before), 3),
            "loss_to_training_s": round(max(r["t"] for r in restarted) - killed_at, 3),
            "loss_to_next_step_s": round(min(r["t"] for r in after) - killed_at, 3), "dir": directory}


def print_table(rows: list[dict], size_mb: float) -> None:
    e = next((r for r in rows if r["variant"] == "elastic" and "error" not in r), None)
    t = next((r for r in rows if r["variant"] == "torchrun" and "error" not in r), None)
    print(f"| {size_mb:g} MB, 2 replicas x 2 shards | elastic (HybridShardedState) | torchrun + DCP |")
    print("|---|---|---|")
    def cell(row, key, fmt="{:.3f} s"):
        return fmt.format(row[key]) if row is not None and key in row else "-"
    print(f"| train step + commit/save (median, before) | {cell(e, 'train_loop_s')} | "
          f"{cell(t, 'train_loop_s')} + dcp.save {cell(t, 'dcp_save_s')} |")
    print(f"| host lost -> training again | {cell(e, 'loss_to_training_s')} "
          f"(moved {cell(e, 'loss_moved_mb', '{:.3f} MB')}) | {cell(t, 'loss_to_training_s')} (all 4 restarted) |")
    print(f"| of which: the step in flight until its next collective | {cell(e, 'loss_detected_s')} | - |")
    print(f"| of which: failure seen -> training again (no re-shard) | **{cell(e, 'loss_detected_to_training_s')}** "
          f"(sync {cell(e, 'loss_sync_s')}) | - |")
    print(f"| host lost -> next completed step | {cell(e, 'loss_to_next_step_s')} | {cell(t, 'loss_to_next_step_s')} |")
    print(f"| refill: moved to the new group | {cell(e, 'refill_moved_mb', '{:.0f} MB')} | (the restart above) |")
    print(f"| refill: receivers' sync | {cell(e, 'refill_sync_s')} = **{cell(e, 'refill_s_per_gb', '{:.3f} s/GB')}** | - |")
    print(f"| refill: host a's stall beyond its step | {cell(e, 'refill_host_a_stall_s')} | - |")
    for row in rows:
        if "error" in row:
            print(f"{row['variant']}: {row['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1000.0)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--kill-step", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--elastic-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.elastic_worker:
        return elastic_worker(args)
    if args.torchrun_worker:
        return torchrun_worker(args)
    load_before = os.getloadavg()
    rows = []
    for name, run in (("elastic", run_elastic), ("torchrun", run_torchrun)):
        load, started = os.getloadavg()[0], time.monotonic()
        try:
            row = run(args)
        except (RuntimeError, OSError, ValueError, KeyError, StopIteration) as exc:
            row = {"variant": name, "error": str(exc)}
        row.update(loadavg_1min=round(load, 2), wall_s=round(time.monotonic() - started, 1))
        print(f"{name}: {json.dumps(row)}", flush=True)
        rows.append(row)
    print_table(rows, args.size_mb)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}; "
          f"after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "loadavg_before": load_before,
                                               "loadavg_after": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
