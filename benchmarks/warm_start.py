"""Warm worker starts against fresh ones, in one run: a job's start, and a SIGKILLed
worker's replacement (``--max-restarts 1``), each with and without ``--cold-starts``.

    python -m benchmarks.warm_start [--reps 3] [--json PATH]

Each rep starts ``elastic-run --np 4 --min-np 3 --max-np 4 --max-restarts 1`` on the
benchmark workload (benchmarks/workload.py, commit every step), the two variants
alternating (the machine is shared and noisy). Figures, wall and CPU:

* start: the launcher's spawn -> every worker's first step (wall); the CPU seconds the
  workers had used by their first step, plus the template's (warm starts);
* replacement: SIGKILL of a non-zero rank -> the replacement's first step (wall; issue
  41's goal: <= 1.0 s), and the CPU seconds the replacement had used by then.

CPU is read from /proc/PID/stat as each worker's first step is seen (polled every 20 ms).
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
VARIANTS = {"warm": [], "cold": ["--cold-starts"]}
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def template_pids(root: int) -> list[int]:
    """The templates under ``root`` (not the workers they forked, which share their command line)."""
    def is_template(pid: int) -> bool:
        try:
            return b"elastic.worker.template" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    def parent(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return 0

    return [pid for pid in harness.descendants(root) if is_template(pid) and not is_template(parent(pid))]


def one_rep(variant: str, args, rng: random.Random) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-warm-{variant}-") as tmp:
        work = Path(tmp)
        timing = work / "timing"
        timing.mkdir()
        command = [str(harness.BIN / "elastic-run"), "--np", str(NPROC), "--min-np", str(NPROC - 1),
                   "--max-np", str(NPROC), "--max-restarts", "1", *VARIANTS[variant], "--log-dir", str(work / "logs"),
                   "-m", harness.WORKLOAD_MODULE, "--mode", "elastic", "--steps", "1000000",
                   "--timing-dir", str(timing), "--commit-every", "1"]
        load = os.getloadavg()[0]
        started = time.time()
        first_cpu: dict[int, float] = {}  # worker pid -> its CPU seconds at its first step seen

        def note_first_steps():
            for w in harness.read_timings(timing):
                if w.steps and w.pid not in first_cpu:
                    first_cpu[w.pid] = cpu_s(w.pid) or 0.0
            return first_cpu

        with harness.Job(command, harness.benchmark_env(), work / "launcher.log") as job:
            if not harness.wait_for(lambda: len(note_first_steps()) >= NPROC or not job.running(), args.timeout,
                                    interval=0.02) or not job.running():
                return {"variant": variant, "error": "the job did not start",
                        "log": (work / "launcher.log").read_text(errors="replace")[-1500:]}
            workers = harness.read_timings(timing)
            start_s = max(w.steps[0][1] for w in workers) - started
            template_cpu = sum(cpu_s(p) or 0.0 for p in template_pids(job.proc.pid))
            start_cpu = sum(first_cpu.values()) + template_cpu
            harness.wait_for(lambda: all(len(w.steps) >= args.warmup_steps for w in harness.read_timings(timing)), 120)
            victim = rng.choice([w for w in workers if w.rank != 0])
            before = set(first_cpu)
            killed = time.time()
            os.kill(victim.pid, signal.SIGKILL)
            replaced = harness.wait_for(lambda: set(note_first_steps()) - before - {victim.pid} or not job.running(),
                                        args.timeout, interval=0.02)
            new = [w for w in harness.read_timings(timing) if w.pid not in before and w.steps]
            if not replaced or not new:
                return {"variant": variant, "error": "no replacement trained",
                        "log": (work / "launcher.log").read_text(errors="replace")[-1500:]}
            return {"variant": variant, "loadavg_1min": load, "start_s": start_s, "start_cpu_s": start_cpu,
                    "template_cpu_s": template_cpu, "replacement_s": new[0].steps[0][1] - killed,
                    "replacement_cpu_s": first_cpu[new[0].pid]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    reps: list[dict] = []
    for i in range(args.reps):
        for variant in (("warm", "cold") if i % 2 == 0 else ("cold", "warm")):
            reps.append(one_rep(variant, args, rng))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in reps[-1].items()}), flush=True)
    figures = ("start_s", "start_cpu_s", "replacement_s", "replacement_cpu_s")
    medians = {v: {f: statistics.median([r[f] for r in reps if r["variant"] == v and f in r] or [float("nan")])
                   for f in figures} for v in VARIANTS}
    load = statistics.median(r.get("loadavg_1min", 0.0) for r in reps)
    print(f"\n{'figure (median of ' + str(args.reps) + ')':<34} {'warm':>8} {'cold':>8}   (load {load:.1f})")
    for f, text in (("start_s", "job start -> all 4 training, s"), ("start_cpu_s", "  CPU s to there (workers+template)"),
                    ("replacement_s", "kill -> replacement's 1st step, s"), ("replacement_cpu_s", "  replacement's CPU s")):
        print(f"{text:<34} {medians['warm'][f]:8.2f} {medians['cold'][f]:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "warm_start", "date": time.strftime("%Y-%m-%d"),
                                               "loadavg_1min": load, "medians": medians, "reps": reps}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
