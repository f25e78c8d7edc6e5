"""Stall of the running workers when a host joins (target <= 0.5 s).

    python -m benchmarks.join [--reps 3] [--json PATH]

Three workers (one agent) train the benchmark workload against an embedded etcd; a
second agent with one worker joins the same job mid-run. The stall is the longest
gap between two consecutive completed steps of the original workers around the
switch, minus their median step time. For comparison, the baseline a torchrun user
has is a restart of every worker (see benchmarks.recovery: several seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from rendezvous import EmbeddedEtcd

from .harness import WORKLOAD_MODULE, BIN, Job, benchmark_env, read_timings, wait_for

TARGET_S = 0.5


def agent_command(endpoint: str, job_id: str, nproc: int, log_dir: Path, workload: list[str]) -> list[str]:
    return [str(BIN / "elastic-run"), "--rdzv-endpoint", endpoint, "--job-id", job_id,
            "--nproc-per-node", str(nproc), "--min-np", "3", "--max-np", "4", "--log-dir", str(log_dir),
            "-m", WORKLOAD_MODULE, "--mode", "elastic", *workload]


def one_rep(rep: int, endpoint: str, steps: int, join_after: int, commit_every: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"bench-join-{rep}-"))
    timing = work / "timing"
    timing.mkdir()
    workload = ["--steps", str(steps), "--timing-dir", str(timing), "--commit-every", str(commit_every)]
    job_id = f"join-{rep}-{work.name[-6:]}"
    env = benchmark_env()
    with Job(agent_command(endpoint, job_id, 3, work / "logs", workload), env, work / "first.log") as first:
        started = wait_for(lambda: any(len(w.steps) >= join_after for w in read_timings(timing)), 180)
        if not started:
            return {"rep": rep, "error": "the first agent made no progress"}
        original = {w.pid for w in read_timings(timing)}
        with Job(agent_command(endpoint, job_id, 1, work / "logs", workload), env, work / "second.log") as second:
            first.wait(300)
            second.wait(60)
    events = [json.loads(l) for l in (work / "logs" / "events.jsonl").read_text().splitlines() if l.strip()]
    switches = [e for e in events if e["event"] == "reform_done" and not e["failed"]]
    if not switches:
        return {"rep": rep, "error": "no switch happened (the joiner came too late?)"}
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
    return {
        "rep": rep,
        "stall_s": max(stalls),
        "median_step_s": statistics.median(medians),
        "switch_total_s": max(e["total_s"] for e in switches),
        "world_sizes": sorted({e["world_size"] for e in switches}),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--join-after", type=int, default=40, help="steps before the second agent starts")
    parser.add_argument("--commit-every", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    results = []
    with EmbeddedEtcd() as etcd:  # started on entry
        for rep in range(1, args.reps + 1):
            result = one_rep(rep, etcd.endpoint, args.steps, args.join_after, args.commit_every)
            results.append(result)
            print(f"rep {rep}/{args.reps}: " + (result.get("error") or
                  f"stall {result['stall_s']:.3f}s (median step {result['median_step_s'] * 1000:.1f} ms, "
                  f"switch {result['switch_total_s']:.3f}s)"), flush=True)
    good = [r["stall_s"] for r in results if "stall_s" in r]
    median = statistics.median(good) if good else None
    print()
    print(f"{'reps':>5} {'ok':>3} {'median stall':>13} {'max stall':>10} {'target':>7}")
    if median is None:
        print(f"{len(results):>5} {0:>3} {'-':>13} {'-':>10} {'<=0.5s':>7}  no rep succeeded")
    else:
        print(f"{len(results):>5} {len(good):>3} {median:>12.3f}s {max(good):>9.3f}s {'<=0.5s':>7}  "
              f"{'ok' if median <= TARGET_S else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"reps": results, "median_stall_s": median, "target_s": TARGET_S}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
