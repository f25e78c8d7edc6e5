"""Stall of the running workers when a host joins, per size of the state.

    python -m benchmarks.join [--state-mb 6,400,900] [--reps 3] [--ddp-init-sync] [--json PATH]

Three workers (one agent) train the benchmark workload against an embedded etcd; a
second agent with one worker joins the same job mid-run. Each host's start is also timed:
from its ``elastic-run`` start to its first step, for the first round's host and for the
joiner (issue 30: a joining host should not start slower than a host of the first round).
The stall is the longest
gap between two consecutive completed steps of the original workers around the
switch, minus their median step time. ``--state-mb`` grows the state with ballast
(benchmarks/workload.py): what the joiner must receive grows, the step does not.
``--ddp-init-sync`` constructs DDP with its initial broadcast (what scripts did before
``state.sync()`` made it redundant). For comparison, the baseline a torchrun user has
is a restart of every worker (see benchmarks.recovery: several seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from elastic.rendezvous import EmbeddedEtcd

from .harness import WORKLOAD_MODULE, BIN, Job, PeakMemory, benchmark_env, read_timings, wait_for

TARGET_S = 0.5


def agent_command(endpoint: str, job_id: str, nproc: int, log_dir: Path, workload: list[str]) -> list[str]:
    return [str(BIN / "elastic-run"), "--rdzv-endpoint", endpoint, "--job-id", job_id,
            "--nproc-per-node", str(nproc), "--min-np", "3", "--max-np", "4", "--log-dir", str(log_dir),
            "-m", WORKLOAD_MODULE, "--mode", "elastic", *workload]


def one_rep(rep: int, endpoint: str, args, state_mb: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"bench-join-{rep}-"))
    timing = work / "timing"
    timing.mkdir()
    workload = ["--steps", str(args.steps), "--timing-dir", str(timing), "--commit-every", str(args.commit_every),
                "--state-mb", str(state_mb)] + (["--ddp-init-sync"] if args.ddp_init_sync else [])
    job_id = f"join-{rep}-{work.name[-6:]}"
    env = benchmark_env()
    load_before = os.getloadavg()[0]
    first_started = time.time()  # the workload stamps its steps with time.time()
    with Job(agent_command(endpoint, job_id, 3, work / "logs", workload), env, work / "first.log") as first:
        memory = PeakMemory(first.proc.pid)
        started = wait_for(lambda: any(len(w.steps) >= args.join_after for w in read_timings(timing)), 300)
        if not started:
            memory.stop()
            return {"rep": rep, "state_mb": state_mb, "error": "the first agent made no progress"}
        original = {w.pid for w in read_timings(timing)}
        joiner_started = time.time()
        with Job(agent_command(endpoint, job_id, 1, work / "logs", workload), env, work / "second.log") as second:
            joiner_memory = PeakMemory(second.proc.pid)
            first.wait(600)
            second.wait(60)
        peak_running = memory.stop(original)
        peak_joiner = joiner_memory.stop()
    events = [json.loads(l) for l in (work / "logs" / "events.jsonl").read_text().splitlines() if l.strip()]
    switches = [e for e in events if e["event"] == "reform_done" and not e["failed"]]
    if not switches:
        return {"rep": rep, "state_mb": state_mb, "error": "no switch happened (the joiner came too late?)"}
    switch_time = min(e["time"] for e in switches)
    stalls, medians = [], []
    for worker in read_timings(timing):
        if worker.pid not in original or len(worker.steps) < 10:
            continue
        times = [t for _, t in worker.steps]
        deltas = [b - a for a, b in zip(times, times[1:])]
        median = statistics.median(deltas)
        around = [b - a for a, b in zip(times, times[1:]) if a - 5.0 <= switch_time <= b + 5.0]
        stalls.append(max(around, default=median) - median)
        medians.append(median)
    running = [e for e in switches if e.get("pid") in original] or switches
    first_steps = {w.pid: w.steps[0][1] for w in read_timings(timing) if w.steps}
    joiner_steps = [t for pid, t in first_steps.items() if pid not in original]
    return {
        "rep": rep,
        "state_mb": state_mb,
        "stall_s": max(stalls),
        "median_step_s": statistics.median(medians),
        "switch_total_s": max(e["total_s"] for e in switches),
        "sync_s_running": max(e["sync_s"] for e in running),
        "sync_s_all": max(e["sync_s"] for e in switches),
        "peak_rss_mb_running": peak_running,
        "peak_rss_mb_joiner": peak_joiner,
        # elastic-run start -> the host's first step (its first worker's, for the first host)
        "first_host_start_s": min(t for pid, t in first_steps.items() if pid in original) - first_started,
        "joiner_start_s": (min(joiner_steps) - joiner_started) if joiner_steps else None,
        "world_sizes": sorted({e["world_size"] for e in switches}),
        "loadavg_1min": load_before,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--state-mb", default="6", help="comma-separated sizes of the state in MB")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--join-after", type=int, default=40, help="steps before the second agent starts")
    parser.add_argument("--commit-every", type=int, default=1)
    parser.add_argument("--ddp-init-sync", action="store_true", help="DDP broadcasts at construction (old way)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.state_mb.split(",") if s]
    results = []
    with EmbeddedEtcd() as etcd:  # started on entry
        for state_mb in sizes:
            for rep in range(1, args.reps + 1):
                result = one_rep(rep, etcd.endpoint, args, state_mb)
                results.append(result)
                print(f"{state_mb:g} MB rep {rep}/{args.reps}: " + (result.get("error") or
                      f"stall {result['stall_s']:.3f}s (median step {result['median_step_s'] * 1000:.1f} ms, "
                      f"switch {result['switch_total_s']:.3f}s, sync running {result['sync_s_running']:.3f}s, "
                      f"peak RSS running {result['peak_rss_mb_running']:.0f} MB, joiner "
                      f"{result['peak_rss_mb_joiner'] or 0:.0f} MB, start to first step: first host "
                      f"{result['first_host_start_s']:.2f}s, joiner {result['joiner_start_s'] or float('nan'):.2f}s, load {result['loadavg_1min']:.1f})"), flush=True)
    summaries = []
    print()
    print(f"{'state MB':>9} {'ok':>4} {'median stall':>13} {'max stall':>10} {'sync (running)':>15} "
          f"{'peak RSS running/joiner':>24} {'start->step first/joiner':>25}")
    for state_mb in sizes:
        good = [r for r in results if r["state_mb"] == state_mb and "stall_s" in r]
        if not good:
            print(f"{state_mb:>9g} {0:>4}  no rep succeeded")
            continue
        summary = {
            "state_mb": state_mb,
            "reps": len(good),
            "median_stall_s": statistics.median(r["stall_s"] for r in good),
            "max_stall_s": max(r["stall_s"] for r in good),
            "median_sync_running_s": statistics.median(r["sync_s_running"] for r in good),
            "peak_rss_mb_running": max(r["peak_rss_mb_running"] or 0 for r in good),
            "peak_rss_mb_joiner": max(r["peak_rss_mb_joiner"] or 0 for r in good),
            "median_first_host_start_s": statistics.median(r["first_host_start_s"] for r in good),
            "median_joiner_start_s": statistics.median(
                [r["joiner_start_s"] for r in good if r["joiner_start_s"] is not None] or [float("nan")]),
        }
        summaries.append(summary)
        print(f"{state_mb:>9g} {len(good):>4} {summary['median_stall_s']:>12.3f}s {summary['max_stall_s']:>9.3f}s "
              f"{summary['median_sync_running_s']:>14.3f}s "
              f"{summary['peak_rss_mb_running']:>11.0f}/{summary['peak_rss_mb_joiner']:.0f} MB "
              f"{summary['median_first_host_start_s']:>15.2f}s/{summary['median_joiner_start_s']:.2f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"summaries": summaries, "reps": results, "target_s": TARGET_S,
                                               "ddp_init_sync": args.ddp_init_sync}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
