"""Recovery benchmark: SIGKILL of 1 of 4 local workers -> next completed step.

    python -m benchmarks.recovery [--reps 3] [--plain-reps 2] [--json PATH] [--only torchrun|elastic]
                                  [--state-mb 6,400,900] [--ddp-init-sync] [--np 4]

``--np`` sets the world (4 by default; 8 and 16 show how a recovery's cost grows with it).

Variants (same script core, benchmarks/workload.py):
  torchrun          torchrun --standalone --nproc-per-node 4 --max-restarts 3 (may never
                    recover: stale peer addresses in the shared store, pytorch issue 135712)
  torchrun-noshare  the same with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the workaround)
  elastic           elastic-run --np 4 --min-np 2 --max-np 4, commit every step

Each rep: start the job, wait for a warm-up, run on to a random step, SIGKILL one
random non-zero rank, then measure from the timing files the time to the next step
completed on any survivor (and that time less one median step before the kill: the stall
beyond re-running the interrupted step) and to the first step completed by every worker of the new
world. A variant that shows no step within --recover-timeout is "did not recover".
For elastic-run the phases of the re-formation come from events.jsonl (reform_done):
notice (the kill until the last survivor's collective failed, or its ring was aborted),
detect (leaving the old ring), rendezvous, pg_init (of which pg_store: connecting to the
round's store, pg_arrive: waiting there for the others, pg_group: init_process_group),
sync, total (notice to sync done),
each the slowest survivor's, printed beside the figures of PREVIOUS.
With --state-mb the state (parameters + momentum) is grown with ballast to each size in
turn (benchmarks/workload.py: the step time stays the same); torchrun then checkpoints
and reloads a file of that size. --ddp-init-sync makes the elastic workers construct DDP
with its initial broadcast, as scripts did before ``state.sync()`` made it redundant.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import harness

NPROC = 4
PHASES = ("notice_s", "detect_s", "rendezvous_s", "pg_init_s", "pg_store_s", "pg_arrive_s", "pg_group_s",
          "sync_s", "total_s")
# The last stop's idle-machine medians (BENCHMARKS.md, 2026-11-27 second stop), for the
# phase table; notice was not measured then.
PREVIOUS = {"median_s": 0.455, "detect_s": 0.263, "rendezvous_s": 0.001, "pg_init_s": 0.264, "sync_s": 0.011,
            "total_s": 0.305}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="reps per variant")
    parser.add_argument("--plain-reps", type=int, default=2,
                        help="reps of plain torchrun (it is expected not to recover: each costs the full timeout)")
    parser.add_argument("--only", choices=["torchrun", "elastic"], help="run only these variants")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--recover-timeout", type=float, default=60.0)
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--checkpoint-every", type=int, default=20, help="torchrun: checkpoint file every N steps")
    parser.add_argument("--seed", type=int, default=None, help="seed of the random kill points")
    parser.add_argument("--state-mb", default="6", help="comma-separated sizes of the state in MB, one run each")
    parser.add_argument("--ddp-init-sync", action="store_true", help="elastic: DDP broadcasts at construction")
    parser.add_argument("--np", type=int, default=NPROC, dest="nproc", help="workers of the job (at least 3)")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def variant_commands(name: str, workdir: Path, args, state_mb: float) -> tuple[list[str], dict[str, str]]:
    timing = ["--steps", "1000000", "--timing-dir", str(workdir / "timing"), "--state-mb", str(state_mb)]
    if name.startswith("torchrun"):
        workload = [*timing, "--checkpoint", str(workdir / "ckpt.pt"), "--checkpoint-every", str(args.checkpoint_every)]
        extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if name == "torchrun-noshare" else {}
        return harness.torchrun_command(args.nproc, workload, max_restarts=3), harness.benchmark_env(**extra)
    sync = ["--ddp-init-sync"] if args.ddp_init_sync else []
    command = harness.elastic_command(args.nproc, 2, args.nproc, workdir / "logs", [*timing, "--commit-every", "1", *sync])
    return command, harness.benchmark_env()


def one_rep(name: str, args, rng: random.Random, state_mb: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        workdir = Path(tmp)
        (workdir / "timing").mkdir()
        command, env = variant_commands(name, workdir, args, state_mb)
        load = os.getloadavg()[0]
        with harness.Job(command, env, workdir / "launcher.log") as job:
            memory = harness.PeakMemory(job.proc.pid)
            result = kill_and_measure(job, workdir, args, rng, name)
            result["peak_rss_mb"] = memory.stop({w.pid for w in harness.read_timings(workdir / "timing")})
            result["state_mb"], result["loadavg_1min"] = state_mb, load
            result["launcher_exit_code"] = job.proc.poll()
            if result.get("error") or not result.get("recovered"):
                result["launcher_log_tail"] = (workdir / "launcher.log").read_text(errors="replace")[-2000:]
        return result


def kill_and_measure(job: harness.Job, workdir: Path, args, rng: random.Random, name: str) -> dict:
    timing_dir = workdir / "timing"

    def warmed_up():
        workers = harness.read_timings(timing_dir)
        return len(workers) >= args.nproc and all(len(w.steps) >= args.warmup_steps for w in workers) and workers

    if not harness.wait_for(lambda: warmed_up() or not job.running(), args.start_timeout) or not job.running():
        return {"error": "job did not start (or exited) before warm-up"}
    target = max(len(w.steps) for w in harness.read_timings(timing_dir)) + rng.randint(0, 20)
    harness.wait_for(lambda: max(len(w.steps) for w in harness.read_timings(timing_dir)) >= target, 30)

    workers = harness.read_timings(timing_dir)
    ours = harness.descendants(job.proc.pid)
    candidates = [w for w in workers if w.rank != 0 and w.pid in ours]
    if not candidates:
        return {"error": "no killable non-zero rank found among the launcher's descendants"}
    victim = rng.choice(candidates)
    kill_time = time.time()
    os.kill(victim.pid, signal.SIGKILL)

    def recovered():
        timings = harness.read_timings(timing_dir)
        recovery = harness.measure_recovery(timings, victim.pid, kill_time, expected_workers(name, args.nproc))
        return recovery if recovery.kill_to_all_survivors_s is not None else None

    harness.wait_for(lambda: recovered() or not job.running(), args.recover_timeout, interval=0.1)
    timings = harness.read_timings(timing_dir)
    recovery = harness.measure_recovery(timings, victim.pid, kill_time, expected_workers(name, args.nproc))
    # The figure is the stall beyond re-running the interrupted step: one step of
    # this size (the median before the kill) is part of any kill -> next step time.
    step_times = [m for w in timings
                  if (m := harness.median_step_time(tuple(s for s in w.steps if s[1] <= kill_time), warmup=5)) is not None]
    step_s = statistics.median(step_times) if step_times else None
    result = {
        "step_s": step_s,
        "beyond_step_s": (recovery.kill_to_next_step_s - step_s
                          if recovery.kill_to_next_step_s is not None and step_s is not None else None),
        "victim_rank": victim.rank,
        "killed_after_step": recovery.last_step_before_kill,
        "recovered": recovery.kill_to_next_step_s is not None,
        "kill_to_next_step_s": recovery.kill_to_next_step_s,
        "kill_to_all_survivors_s": recovery.kill_to_all_survivors_s,
        "first_step_after_kill": recovery.first_step_after_kill,
        "launcher_exited": not job.running(),
    }
    if name == "elastic":
        result["phases"] = reform_phases(workdir / "logs" / "events.jsonl", kill_time)
    return result


def expected_workers(name: str, nproc: int) -> int:
    # torchrun restarts the whole local group (4 fresh workers); elastic-run goes on with 3.
    return nproc if name.startswith("torchrun") else nproc - 1


def reform_phases(events_path: Path, kill_time: float) -> dict | None:
    """The first reform_done event after the kill (one per worker: take the slowest)."""
    if not events_path.exists():
        return None
    events = []
    for line in events_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "reform_done" and event.get("time", 0) > kill_time:
            events.append(event)
    if not events:
        return None
    first_round = min(e.get("round") or 0 for e in events)
    same_round = [e for e in events if (e.get("round") or 0) == first_round]
    # A survivor's failure was noticed total_s before its reform_done.
    for e in same_round:
        e["notice_s"] = max(0.0, e["time"] - (e.get("total_s") or 0.0) - kill_time)
    return {phase: max(e.get(phase) or 0.0 for e in same_round) for phase in PHASES}


def summarize(name: str, reps: list[dict], state_mb: float) -> dict:
    times = [r["kill_to_next_step_s"] for r in reps if r.get("recovered")]
    everyone = [r["kill_to_all_survivors_s"] for r in reps if r.get("kill_to_all_survivors_s") is not None]
    summary = {
        "variant": name,
        "state_mb": state_mb,
        "reps": len(reps),
        "peak_rss_mb": max((r.get("peak_rss_mb") or 0 for r in reps), default=None),
        "loadavg_1min": statistics.median(r["loadavg_1min"] for r in reps) if reps else None,
        "recovered": len(times),
        "median_s": statistics.median(times) if times else None,
        "p90_s": harness.percentile(times, 0.9),
        "median_all_survivors_s": statistics.median(everyone) if everyone else None,
        "median_step_s": _median([r.get("step_s") for r in reps]),
        "median_beyond_step_s": _median([r.get("beyond_step_s") for r in reps if r.get("recovered")]),
    }
    phases = [r["phases"] for r in reps if r.get("phases")]
    if phases:
        summary["phases_median_s"] = {p: statistics.median(ph[p] for ph in phases) for p in PHASES}
    return summary


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def print_table(summaries: list[dict]) -> None:
    print(f"\n{'MB':>5} {'variant':18} {'recovered':>10} {'median':>9} {'p90':>9} {'all survivors':>14} "
          f"{'step':>7} {'beyond step':>12} {'RSS MB':>7}  phases (median)")
    for s in summaries:
        recovered = f"{s['recovered']}/{s['reps']}"
        phases = s.get("phases_median_s")
        phase_text = " ".join(f"{k[:-2]}={v:.3f}" for k, v in phases.items()) if phases else ""
        if not s["recovered"]:
            phase_text = "did not recover"
        print(f"{s['state_mb']:>5g} {s['variant']:18} {recovered:>10} {harness.fmt(s['median_s']):>9} {harness.fmt(s['p90_s']):>9} "
              f"{harness.fmt(s['median_all_survivors_s']):>14} {harness.fmt(s['median_step_s']):>7} "
              f"{harness.fmt(s['median_beyond_step_s']):>12} {s['peak_rss_mb'] or 0:>7.0f}  {phase_text}")


def print_phases(summaries: list[dict]) -> None:
    """Each phase's median beside the previous figures (PREVIOUS)."""
    for s in summaries:
        phases = s.get("phases_median_s")
        if not phases:
            continue
        print(f"\n{s['variant']} @ {s['state_mb']:g} MB, slowest survivor per rep, median over reps:")
        print(f"  {'phase':14} {'previous':>9} {'now':>9}")
        for name, now in [("median_s", s.get("median_s")), *phases.items()]:
            print(f"  {name[:-2]:14} {harness.fmt(PREVIOUS.get(name)):>9} {harness.fmt(now):>9}")


def main(argv=None) -> None:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    variants = {"torchrun": args.plain_reps, "torchrun-noshare": args.reps, "elastic": args.reps}
    if args.only:
        variants = {k: v for k, v in variants.items() if k.startswith(args.only)}
    results, summaries = {}, []
    for state_mb in [float(s) for s in args.state_mb.split(",") if s]:
        for name, reps in variants.items():
            if reps < 1:
                continue
            key = f"{name}@{state_mb:g}MB"
            results[key] = []
            for rep in range(reps):
                started = time.monotonic()
                result = one_rep(name, args, rng, state_mb)
                results[key].append(result)
                print(f"{key} rep {rep + 1}/{reps}: "
                      f"{'did not recover' if not result.get('recovered') else harness.fmt(result['kill_to_next_step_s'])}"
                      f" (step {harness.fmt(result.get('step_s'))})"
                      f"{' ' + result['error'] if result.get('error') else ''} "
                      f"(killed rank {result.get('victim_rank')} after step {result.get('killed_after_step')}, "
                      f"resumed at step {result.get('first_step_after_kill')}; peak RSS {result.get('peak_rss_mb') or 0:.0f} MB, "
                      f"load {result['loadavg_1min']:.1f}; rep took {time.monotonic() - started:.0f}s)",
                      flush=True)
            summaries.append(summarize(name, results[key], state_mb))
    print_table(summaries)
    print_phases(summaries)
    if args.json:
        Path(args.json).write_text(json.dumps({"np": args.nproc, "summaries": summaries, "reps": results}, indent=2))


if __name__ == "__main__":
    main()
