"""Run ``elastic-run`` as a real process and watch what its workers write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from tests.fakes.jsonl import read_jsonl  # noqa: F401 (tests import it from here)
from tests.fakes.waiting import poll

REPO = Path(__file__).resolve().parents[2]
TRAIN_JOB = REPO / "tests" / "fakes" / "train_job.py"
ELASTIC_RUN = [sys.executable, "-m", "elastic.cli"]


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    value = poll(predicate, timeout, interval)
    if not value:
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
    return value


class Job:
    """One elastic-run process (one agent) with its own output file."""

    def __init__(self, tmp: Path, args: list[str], *, name: str = "job", env: Optional[dict] = None,
                 prefix: Sequence[str] = (), cwd: Optional[Path] = None):
        """``prefix`` goes before the command, e.g. ``ip netns exec <ns>`` (tests/fakes/netns.py).
        ``cwd``: the repository root by default; the GPU checks run elsewhere, since there
        the installed wheel's ``elastic``, not the checkout's, must come first."""
        self.tmp = tmp
        self.name = name
        self.out = tmp / "out"
        self.log_dir = tmp / "logs"
        self.output = tmp / f"{name}.txt"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
        full_env.update(env or {})
        # A test's own PYTHONPATH entries (a sitecustomize that injects faults) come first, then
        # the caller's (the GPU bundle's site folder), then the repository.
        entries = [p for value in ((env or {}).get("PYTHONPATH"), os.environ.get("PYTHONPATH"), str(REPO))
                   for p in (value or "").split(os.pathsep) if p]
        full_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(entries))
        self._file = open(self.output, "wb")
        self.proc = subprocess.Popen(
            [*prefix, *ELASTIC_RUN, *args], cwd=cwd or REPO, env=full_env, stdout=self._file, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @staticmethod
    def train_args(out: Path, log_dir: Path, launcher: list[str], script_args: list[str]) -> list[str]:
        return [*launcher, "--log-dir", str(log_dir), str(TRAIN_JOB), "--out", str(out), *script_args]

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def steps(self) -> list[dict]:
        return read_jsonl(self.out / "steps.jsonl")

    def pids(self) -> list[dict]:
        return read_jsonl(self.out / "pids.jsonl")

    def events(self) -> list[dict]:
        return read_jsonl(self.log_dir / "events.jsonl")

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        # Generous: on a loaded 2-core machine, starting workers that import torch takes long.
        wait_until(lambda: any(s["step"] >= step for s in self.steps()), timeout, f"step {step}")

    def worker_pid(self, rank: int) -> int:
        """The live worker holding ``rank`` in the newest round."""
        entries = self.pids()
        newest = max(e["round"] for e in entries)
        return next(e["pid"] for e in entries if e["round"] == newest and e["rank"] == rank)

    def wait(self, timeout: float = 120, also: Sequence["Job"] = ()) -> int:
        """The exit code; past ``timeout`` the job is killed and the assertion shows the end
        of its console and of the consoles of ``also`` (the other agents of the job)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                # In slices, so that another agent of the job failing ends the wait at once.
                return self.proc.wait(min(1.0, max(0.0, deadline - time.monotonic())) if also else timeout)
            except subprocess.TimeoutExpired:
                failed = [job for job in also if job.proc.poll() not in (None, 0)]
                if not failed and time.monotonic() < deadline:
                    continue
                break
        self.kill()
        others = "".join(f"\n--- {job.name}:\n{job.text()[-3000:]}" for job in also)
        why = f"{failed[0].name} exited {failed[0].proc.returncode}" if failed else f"did not finish within {timeout}s"
        raise AssertionError(f"elastic-run {self.name}: {why}:\n{self.text()[-3000:]}{others}")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._file.close()


def one_worker_hosts(tmp_path: Path, endpoint: str, job_id: str, launcher: list[str], script: list[str],
                     names: Sequence[str] = ("a", "b")) -> list[Job]:
    """One loopback agent per name, one worker each, all of one job on the etcd at ``endpoint``
    (``--min-np``/``--max-np`` = the number of hosts; ``launcher`` adds options). Each agent
    has its own home ``tmp_path/<name>`` with its ``out`` and ``logs``."""
    agents = []
    for name in names:
        home = tmp_path / name
        home.mkdir()
        agents.append(Job(home, Job.train_args(
            home / "out", home / "logs",
            ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--host-id", name, "--host-addr", "127.0.0.1",
             "--nproc-per-node", "1", "--min-np", str(len(names)), "--max-np", str(len(names)), *launcher],
            script), name=name))
    return agents
