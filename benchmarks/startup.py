"""Start to exit: `elastic-run --np 1 SCRIPT` against `torchrun --standalone`, same script.

    python -m benchmarks.startup [--runs 5] [--json PATH]

Two scripts: one that imports torch (what every training script pays), one that imports
nothing (the launcher's own cost). Each run is a fresh process from the shell's point of
view: wall time from spawning the launcher to its exit, exit status 0 required. The
launchers alternate run by run (the machine is shared and noisy) and the table gives the
median of each, and the ratio of the medians (goal: elastic-run <= 0.9x torchrun for the
script that imports torch, issue 30).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import BIN, REPO, benchmark_env

SCRIPTS = {"imports torch": "import torch\n", "imports nothing": "pass\n"}
GOAL = 0.9  # elastic-run / torchrun, for the script that imports torch


def launcher_command(launcher: str, script: Path) -> list[str]:
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=1", str(script)]
    return [sys.executable, "-m", "elastic.cli", "--np", "1", str(script)]


def one_run(launcher: str, script: Path, timeout: float) -> float:
    started = time.perf_counter()
    done = subprocess.run(launcher_command(launcher, script), env=benchmark_env(), cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{launcher} {script.name} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return took


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for name, body in SCRIPTS.items():
            script = Path(tmp) / f"{name.replace(' ', '_')}.py"
            script.write_text(body)
            times: dict[str, list[float]] = {"torchrun": [], "elastic-run": []}
            for i in range(args.runs):
                order = ("torchrun", "elastic-run") if i % 2 == 0 else ("elastic-run", "torchrun")
                for launcher in order:
                    times[launcher].append(one_run(launcher, script, args.timeout))
            medians = {k: statistics.median(v) for k, v in times.items()}
            results[name] = {"runs_s": times, "median_s": medians,
                             "ratio": medians["elastic-run"] / medians["torchrun"]}
    print(f"{'script':<16} {'torchrun':>9} {'elastic-run':>12} {'ratio':>7}  (median of {args.runs}, wall s)")
    for name, r in results.items():
        print(f"{name:<16} {r['median_s']['torchrun']:9.2f} {r['median_s']['elastic-run']:12.2f} {r['ratio']:6.2f}x")
    torch_ratio = results["imports torch"]["ratio"]
    print(f"goal: elastic-run <= {GOAL}x torchrun for a script that imports torch: "
          f"{'met' if torch_ratio <= GOAL else 'missed'} ({torch_ratio:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "startup", "runs": args.runs, "goal_ratio": GOAL,
                                               "date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
