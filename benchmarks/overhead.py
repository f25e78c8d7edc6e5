"""Steady-state overhead: step time of elastic-run vs torchrun + DDP, same script core.

    python -m benchmarks.overhead [--steps 300] [--rounds 3] [--np 4] [--json PATH] [--only torchrun|elastic]

Configurations (benchmarks/workload.py, no failures):
  torchrun          torchrun --standalone --nproc-per-node N, no checkpoints (the baseline)
  elastic-commit10  elastic-run --np N, state.commit() every 10 steps   (target <= 1.02x)
  elastic-commit1   elastic-run --np N, state.commit() every step       (target <= 1.05x)

The step time of a run is the median of the per-step deltas after --warmup steps,
taken per worker, then the median over workers. The configurations run in
alternating order for --rounds rounds (the machine is shared and noisy); a ratio is
computed per round against that round's torchrun run, and the median ratio reported;
`best ratio` compares the fastest run of each configuration (contention from other
work on the machine only ever adds time, so the minimum is the least noisy figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks import harness

TARGETS = {"elastic-commit10": 1.02, "elastic-commit1": 1.05}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50, help="steps left out of the median")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--np", type=int, default=4, dest="nproc", help="workers per run")
    parser.add_argument("--only", choices=["torchrun", "elastic"], help="run only these configurations")
    parser.add_argument("--run-timeout", type=float, default=600.0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup + 10:
        parser.error("--steps must exceed --warmup by more than 10")
    return args


def command_for(name: str, nproc: int, workdir: Path, steps: int) -> list[str]:
    workload = ["--steps", str(steps), "--timing-dir", str(workdir / "timing")]
    if name == "torchrun":
        return harness.torchrun_command(nproc, workload, max_restarts=0)
    commit_every = {"elastic-commit10": 10, "elastic-commit1": 1}[name]
    return harness.elastic_command(nproc, nproc, nproc, workdir / "logs", [*workload, "--commit-every", str(commit_every)])


def one_run(name: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        workdir = Path(tmp)
        with harness.Job(command_for(name, args.nproc, workdir, args.steps), harness.benchmark_env(),
                         workdir / "launcher.log") as job:
            exit_code = job.wait(args.run_timeout)
        workers = harness.read_timings(workdir / "timing")
        per_worker = [m for w in workers if (m := harness.median_step_time(w.steps, args.warmup)) is not None]
        result = {"exit_code": exit_code, "workers": len(workers),
                  "step_s": statistics.median(per_worker) if per_worker else None}
        if exit_code != 0 or result["step_s"] is None:
            result["launcher_log_tail"] = (workdir / "launcher.log").read_text(errors="replace")[-2000:]
        return result


def ms(seconds: float | None) -> str:
    return harness.fmt(None if seconds is None else seconds * 1000, "ms")


def main(argv=None) -> None:
    args = parse_args(argv)
    names = ["torchrun", "elastic-commit10", "elastic-commit1"]
    if args.only:
        names = [n for n in names if n.startswith(args.only)]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for round_no in range(args.rounds):
        # Alternate the order, so that a drift of the machine does not favour one side.
        order = names if round_no % 2 == 0 else list(reversed(names))
        for name in order:
            result = one_run(name, args)
            runs[name].append(result)
            print(f"round {round_no + 1}/{args.rounds} {name}: step {harness.fmt(result['step_s'])} "
                  f"(exit {result['exit_code']})", flush=True)

    summaries = []
    for name in names:
        times = [r["step_s"] for r in runs[name] if r["step_s"] is not None]
        summary = {"config": name, "runs": len(runs[name]), "median_step_s": statistics.median(times) if times else None,
                   "best_step_s": min(times) if times else None}
        if name in TARGETS and "torchrun" in runs:
            ratios = [r["step_s"] / b["step_s"] for r, b in zip(runs[name], runs["torchrun"]) if r["step_s"] and b["step_s"]]
            summary["ratio"] = statistics.median(ratios) if ratios else None
            baseline = [r["step_s"] for r in runs["torchrun"] if r["step_s"]]
            summary["best_ratio"] = min(times) / min(baseline) if times and baseline else None
            summary["target"] = TARGETS[name]
        summaries.append(summary)

    print(f"\n{'config':18} {'runs':>5} {'median step':>12} {'best step':>10} {'ratio':>7} {'best ratio':>10} {'target':>7}")
    for s in summaries:
        ratio = "-" if s.get("ratio") is None else f"{s['ratio']:.3f}"
        best_ratio = "-" if s.get("best_ratio") is None else f"{s['best_ratio']:.3f}"
        target = f"<={s['target']}" if "target" in s else ""
        print(f"{s['config']:18} {s['runs']:>5} {ms(s['median_step_s']):>12} {ms(s['best_step_s']):>10} "
              f"{ratio:>7} {best_ratio:>10} {target:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps({"nproc": args.nproc, "steps": args.steps, "summaries": summaries,
                                               "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
