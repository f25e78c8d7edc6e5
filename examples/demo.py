"""The README demo: an elastic job that loses a worker and gains one, on one machine.

1. `elastic-run --np 4` trains the digits MLP on an embedded etcd;
2. one worker is killed with SIGKILL mid-run: the other three re-form in-process;
3. a second `elastic-run` joins the same job with one more worker: the ring grows;
4. the events (with their durations) and the final test accuracy are printed;
5. `elastic-run timeline` draws what happened into a PNG whose path is printed last.

Other arguments are passed on to digits.py. `python examples/demo.py --global-batch-size 100`
runs the same demo with a constant global batch, and then digits.py once more as a
plain process (a world of one, the same arguments and seed) and prints both final
test accuracies and the largest difference between the two runs' final parameters:
the kill and the join do not change the result. Add --float64 to see the parameters
agree to about 1e-15 (in float32 the ranks' gradient sums round differently).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIGITS = str(HERE / "digits.py")
TRAIN_ARGS = ["--epochs", "30", "--step-delay", "0.03"]


def stream(proc, prefix, lines):
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        lines.append(line)
        if "Warning" not in line and "warnings.warn" not in line:
            print(f"{prefix}{line}", flush=True)


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise SystemExit(f"demo: timed out waiting for {what}")


def events(path):
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Any other argument is passed on to examples/digits.py.")
    parser.add_argument("--global-batch-size", type=int,
                        help="train with this constant global batch, then run digits.py alone and compare")
    options, rest = parser.parse_known_args(argv)
    if options.global_batch_size is not None and options.global_batch_size < 1:
        parser.error("--global-batch-size must be >= 1")
    return options, rest


def main(argv=None) -> int:
    options, rest = parse_args(argv)
    train_args = [*TRAIN_ARGS, *rest]  # later options win in argparse
    logs = Path(tempfile.mkdtemp(prefix="elastic-demo-"))
    events_file = logs / "events.jsonl"
    elastic_result = logs / "elastic-result.json"
    if options.global_batch_size is not None:
        train_args += ["--global-batch-size", str(options.global_batch_size)]
    # Rank 0 of the last world writes its final parameters, to compare with the run alone.
    job_args = [*train_args, "--out", str(elastic_result)] if options.global_batch_size else train_args
    cmd = [sys.executable, "-m", "elastic.cli", "--np", "4", "--min-np", "2", "--max-np", "4",
           "--log-dir", str(logs), DIGITS, *job_args]
    print("demo: $ elastic-run --np 4 --min-np 2 --max-np 4 --log-dir", logs, "examples/digits.py", *job_args)
    first_lines: list[str] = []
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    threading.Thread(target=stream, args=(first, "", first_lines), daemon=True).start()
    try:
        endpoint = wait_for(
            lambda: next((m.group(1) for l in first_lines for m in [re.search(r"embedded etcd at (\S+);", l)] if m), None),
            60, "the embedded etcd")
        wait_for(lambda: any("epoch 0" in l for l in first_lines), 120, "training to start")
        time.sleep(1.0)
        victim = next(e for e in events(events_file) if e["event"] == "worker_started" and e["rank"] == 2)
        print(f"\ndemo: killing worker {victim['worker']} (rank 2, pid {victim['pid']}) with SIGKILL\n", flush=True)
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: sum(e["event"] == "reform_done" for e in events(events_file)) >= 3, 90, "the ring to re-form")
        time.sleep(2.0)
        print("\ndemo: a second elastic-run joins with one more worker\n", flush=True)
        join = [sys.executable, "-m", "elastic.cli", "--rdzv-endpoint", endpoint, "--job-id", "local",
                "--nproc-per-node", "1", "--min-np", "2", "--max-np", "4", "--log-dir", str(logs), DIGITS, *job_args]
        second = subprocess.Popen(join, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=stream, args=(second, "(joiner) ", []), daemon=True).start()
        first_code = first.wait(600)
        second_code = second.wait(60)
    finally:
        for proc in [first] + ([second] if "second" in locals() else []):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    print("\ndemo: what happened (events.jsonl):")
    t0 = None
    for e in events(events_file):
        if e["event"] not in ("round_formed", "worker_exited", "failure_detected", "reform_done", "job_finished"):
            continue
        t0 = t0 or e["time"]
        detail = {k: v for k, v in e.items() if k not in ("time", "event", "host", "reason") and v is not None}
        print(f"  +{e['time'] - t0:7.2f}s  {e['event']:<16} {detail}")
    accuracy = [l for l in first_lines if "test_accuracy" in l]
    print("demo: final:", accuracy[-1] if accuracy else "no accuracy printed")
    print(f"demo: exit codes {first_code} and {second_code}; logs in {logs}")
    picture = logs / "timeline.png"
    drawn = subprocess.run([sys.executable, "-m", "elastic.cli", "timeline", str(logs), "-o", str(picture)])
    if drawn.returncode == 0:
        print(f"demo: the timeline picture: {picture}")
    ok = first_code == 0 and second_code == 0
    if options.global_batch_size is not None:
        ok = compare_with_a_run_alone(train_args, elastic_result, logs) and ok
    return 0 if ok else 1


def compare_with_a_run_alone(train_args: list[str], elastic_result: Path, logs: Path) -> bool:
    """Run digits.py as a plain process (a world of one) and print both results.

    Same arguments and seed, so the same global batches in the same order; only the
    step delay goes, since it paces the demo and does not change what is trained.
    """
    alone_result = logs / "alone-result.json"
    alone_args = [*train_args, "--step-delay", "0", "--out", str(alone_result)]
    print("\ndemo: the same training alone, for reference:")
    print("demo: $ python examples/digits.py", *alone_args, flush=True)
    # Without the launcher's variables digits.py is a world of one, even if this demo
    # itself was started by elastic-run.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    alone = subprocess.Popen([sys.executable, DIGITS, *alone_args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stream(alone, "(alone) ", [])
    if alone.wait() != 0 or not alone_result.exists() or not elastic_result.exists():
        print(f"demo: no comparison: the run alone exited with {alone.returncode}"
              f"{'' if elastic_result.exists() else ' and the elastic run wrote no result'}")
        return False
    elastic_run, run_alone = (json.loads(p.read_text()) for p in (elastic_result, alone_result))
    difference = max(
        (abs(a - b) for name, values in run_alone["params"].items()
         for a, b in zip(values, elastic_run["params"][name])),
        default=0.0,
    )
    print(f"demo: test accuracy with a kill and a join: {elastic_run['test_accuracy']:.4f} "
          f"(step {elastic_run['step']}, ended at world {elastic_run['world_size']})")
    print(f"demo: test accuracy alone (world of one):   {run_alone['test_accuracy']:.4f} (step {run_alone['step']})")
    print(f"demo: largest final parameter difference:   {difference:.3g}")
    return True


if __name__ == "__main__":
    sys.exit(main())
