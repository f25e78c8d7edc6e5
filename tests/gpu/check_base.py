"""What one check of `make gpu-check` is, what it found, and how it runs its child processes.

Kept apart from the runner (check.py) so that the check modules and the runner can
both import it. Every check runs its CUDA work in child processes (the ``TORCH_NCCL_*``
variables are read when a group is made, and some outcomes are the process's death),
each bounded, so a hang costs its check's budget and no more.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Probe:
    """What this machine offers the checks."""

    cuda: bool
    device_count: int
    etcd: Optional[str]  # why no etcd server binary was found, or None if one was


@dataclass
class Outcome:
    """A check's finding: passed or not, a one-line detail, and its figures for the JSON."""

    ok: bool
    detail: str = ""
    figures: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    name: str
    finding: str  # the review's finding(s) it exercises, e.g. "G2"
    budget_s: float  # the whole check, children included; the runner kills it past this
    run: Callable[["Context"], Outcome]
    needs: tuple[str, ...] = ("cuda",)  # of "cuda", "etcd"


@dataclass
class Context:
    """Given to a check's ``run``: where to write, how long it has."""

    workdir: Path
    budget_s: float
    started: float = field(default_factory=time.monotonic)

    def left(self, margin: float = 3.0) -> float:
        return max(1.0, self.budget_s - (time.monotonic() - self.started) - margin)


def skip_reason(check: Check, probe: Probe) -> Optional[str]:
    """Why ``check`` cannot run on this machine, or None."""
    if "cuda" in check.needs and not probe.cuda:
        return "no CUDA here (a CPU build of torch, or no GPU visible)"
    if "etcd" in check.needs and probe.etcd is not None:
        return f"no etcd server binary: {probe.etcd}"
    return None


def child_env(extra: Optional[dict] = None) -> dict:
    """A child's environment: this repository importable, unbuffered output, one GPU,
    NCCL on the loopback (the review's section 4 prerequisites); ``extra`` wins."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.update(extra or {})
    return env


@dataclass
class Child:
    """One child process's end: status (None if killed at the bound), output, and when it ended."""

    rc: Optional[int]
    out: str
    err: str
    ended: float  # time.time()

    def lines(self, prefix: str) -> list[str]:
        return [line[len(prefix):].strip() for line in self.out.splitlines() if line.startswith(prefix)]

    def tail(self, n: int = 300) -> str:
        return " ".join(self.err.strip().splitlines()[-3:])[-n:]


def run_children(commands: Sequence[Sequence[str]], envs: Sequence[dict], timeout_s: float,
                 cwd: Path = REPO) -> list[Child]:
    """Run the commands at once, each in its own session; wait for all of them at most
    ``timeout_s`` in total, then kill what is left (rc None)."""
    procs = [subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for cmd, env in zip(commands, envs)]
    deadline = time.monotonic() + timeout_s
    ended: dict[int, float] = {}
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.05)
    children = []
    for i, proc in enumerate(procs):
        if i not in ended:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate(timeout=30)
        children.append(Child(proc.returncode if i in ended else None, out, err, ended.get(i, time.time())))
    return children


def python_c(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]
