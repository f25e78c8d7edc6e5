"""Helpers shared by the benchmarks: launch a job, watch its step timings, kill a worker.

A job is a launcher (torchrun or elastic-run) started in its own process group, so
that everything it spawned can be killed at once. Workers are found through the
timing files that benchmarks/workload.py writes (rank<R>.<pid>.steps): the file name
gives the rank at start and the pid, and the pid is checked to be a descendant of
the launcher before anything is signalled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
# Launched as a module from the repository root: run as a script, benchmarks/ would
# come first on sys.path and benchmarks/checkpoint.py would shadow the `checkpoint` package.
WORKLOAD_MODULE = "benchmarks.workload"
BIN = Path(sys.executable).parent


@dataclasses.dataclass(frozen=True)
class WorkerTimings:
    rank: int  # rank at the worker's start
    pid: int
    steps: tuple[tuple[int, float], ...]  # (step number, completion time)


def torchrun_command(nproc: int, workload_args: list[str], max_restarts: int = 3) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "-m", WORKLOAD_MODULE, "--mode", "torchrun", *workload_args]


def elastic_command(np_: int, min_np: int, max_np: int, log_dir: Path, workload_args: list[str]) -> list[str]:
    return [str(BIN / "elastic-run"), "--np", str(np_), "--min-np", str(min_np), "--max-np", str(max_np),
            "--log-dir", str(log_dir), "-m", WORKLOAD_MODULE, "--mode", "elastic", *workload_args]


def benchmark_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


class Job:
    """A launcher process group; a context manager that always kills what it started."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, cwd: Path = REPO) -> None:
        self.command = command
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM to the whole group, SIGKILL after `grace` seconds; also stray descendants."""
        pids = descendants(self.proc.pid)
        for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            if self.wait(wait_s) is not None and not any(_alive(p) for p in pids):
                break
        for pid in pids:  # workers that moved to another group (none expected)
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._log.close()


def descendants(root: int) -> set[int]:
    """All live descendants of `root`, from /proc (no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def read_timings(timing_dir: Path) -> list[WorkerTimings]:
    workers = []
    for path in sorted(timing_dir.glob("rank*.steps")):
        rank, pid = path.name[len("rank"):-len(".steps")].split(".")
        steps = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:  # a line being written is skipped
                steps.append((int(parts[0]), float(parts[1])))
        workers.append(WorkerTimings(int(rank), int(pid), tuple(steps)))
    return workers


def wait_for(condition: Callable[[], object], timeout: float, interval: float = 0.05):
    """Poll `condition` until it returns something truthy or `timeout` passes (-> None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(interval)
    return None


def median_step_time(steps: tuple[tuple[int, float], ...], warmup: int) -> float | None:
    deltas = [b[1] - a[1] for a, b in zip(steps, steps[1:]) if b[0] == a[0] + 1][warmup:]
    return statistics.median(deltas) if deltas else None


@dataclasses.dataclass(frozen=True)
class Recovery:
    kill_to_next_step_s: float | None  # first step completed after the kill, on any survivor
    kill_to_all_survivors_s: float | None  # every worker of the new world completed one
    last_step_before_kill: int
    first_step_after_kill: int | None  # < last_step_before_kill + 1 means a rollback


def measure_recovery(workers: list[WorkerTimings], victim_pid: int, kill_time: float,
                     expected_workers: int) -> Recovery:
    """Kill -> next completed step, from the timing files.

    A survivor may still complete the step that was in flight at the kill (if the
    victim had already sent its gradients). Such a completion is not a recovery, so a
    worker's first completion after the kill is ignored when it came within one
    median step time of the kill and is that worker's next step number.
    """
    before = [s for w in workers for s in w.steps if s[1] <= kill_time]
    last_step = max((s[0] for s in before), default=0)
    step_times = [m for w in workers if (m := median_step_time(w.steps, warmup=5)) is not None]
    in_flight_window = statistics.median(step_times) if step_times else 0.0
    firsts = []
    for w in workers:
        if w.pid == victim_pid:
            continue
        prior = [s for s in w.steps if s[1] <= kill_time]
        after = [s for s in w.steps if s[1] > kill_time]
        if after and prior and after[0][0] == prior[-1][0] + 1 and after[0][1] - kill_time < in_flight_window:
            after = after[1:]
        if after:
            firsts.append(after[0])
    if not firsts:
        return Recovery(None, None, last_step, None)
    first = min(firsts, key=lambda s: s[1])
    everyone = max(s[1] for s in firsts) - kill_time if len(firsts) >= expected_workers else None
    return Recovery(first[1] - kill_time, everyone, last_step, first[0])


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def fmt(value: float | None, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.3f}{unit}"


class PeakMemory:
    """Samples the peak RSS (VmHWM) of a launcher's descendants while a job runs; the
    kernel keeps each process's peak, so sampling every half second misses nothing
    but the last half second of a process's life."""

    def __init__(self, root_pid: int, interval: float = 0.5) -> None:
        import threading

        self._root, self._interval = root_pid, interval
        self.peak_mb: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for pid in descendants(self._root):
                try:
                    text = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                for line in text.splitlines():
                    if line.startswith("VmHWM:"):
                        mb = int(line.split()[1]) / 1024
                        self.peak_mb[pid] = max(mb, self.peak_mb.get(pid, 0.0))

    def stop(self, pids: set[int] | None = None) -> float | None:
        """The largest peak among ``pids`` (all sampled processes if None), in MB."""
        self._stop.set()
        self._thread.join()
        values = [mb for pid, mb in self.peak_mb.items() if pids is None or pid in pids]
        return max(values, default=None)


def write_json_report(path: str, benchmark: str, **sections) -> None:
    """The benchmark's figures as JSON at ``path`` with the machine they came from."""
    import platform

    import torch

    report = {
        "benchmark": benchmark,
        "created": time.time(),
        "machine": {"python": sys.version.split()[0], "torch": torch.__version__, "cpus": os.cpu_count(),
                    "platform": platform.platform(), "torch_threads": torch.get_num_threads()},
        **sections,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {path}")

