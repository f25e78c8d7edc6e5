"""The README demo: an elastic job that loses a worker and gains one, on one machine.

1. `elastic-run --np 4` trains the digits MLP on an embedded etcd;
2. one worker is killed with SIGKILL mid-run: the other three re-form in-process;
3. a second `elastic-run` joins the same job with one more worker: the ring grows;
4. the events (with their durations) and the final test accuracy are printed;
5. `elastic-run timeline` draws what happened into a PNG whose path is printed last.

Arguments are passed on to digits.py: `python examples/demo.py --global-batch-size 100`
runs the same demo with a constant global batch, whose final accuracy is the one of
`python examples/digits.py --epochs 30 --global-batch-size 100` run alone.
"""

from __future__ import annotations

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


def main() -> int:
    train_args = [*TRAIN_ARGS, *sys.argv[1:]]  # later options win in argparse
    logs = Path(tempfile.mkdtemp(prefix="elastic-demo-"))
    events_file = logs / "events.jsonl"
    cmd = [sys.executable, "-m", "elastic.cli", "--np", "4", "--min-np", "2", "--max-np", "4",
           "--log-dir", str(logs), DIGITS, *train_args]
    print("demo: $ elastic-run --np 4 --min-np 2 --max-np 4 --log-dir", logs, "examples/digits.py", *train_args)
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
                "--nproc-per-node", "1", "--min-np", "2", "--max-np", "4", "--log-dir", str(logs), DIGITS, *train_args]
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
    return 0 if first_code == 0 and second_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
