"""What one GPU check is, what it found, and how it runs its child processes.

Kept apart from the runner (check.py) so that the check modules and the runner can
both import it. Every check runs its CUDA work in child processes (the ``TORCH_NCCL_*``
variables are read when a group is made, and some outcomes are the process's death),
each bounded, so a hang costs its check's budget and no more.

Three rules keep a check's processes the harness's own on a GPU host that has only the
GPU bundle (tests/gpu/run.sh, gpu review N1, N11):

- ``PYTHONPATH`` is extended, never replaced: what the caller had (the bundle's private
  site folder) stays first, and the repository comes after it, for ``tests`` alone, so
  ``elastic`` is the installed wheel's;
- no child runs with the repository root as its working directory (``python -m`` and
  ``-c`` put it first on ``sys.path``, where the checkout's ``elastic/`` would hide the
  wheel's): a check runs in its own work folder;
- every process a check starts, at any depth, inherits ``GPU_CHECK_TAG``, and the runner
  kills whatever still carries the tag when the check ends (``sweep``): agents and
  workers live in sessions of their own, which a process-group kill misses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
TAG = "GPU_CHECK_TAG"  # set by the runner in each check's process; inherited by every descendant


@dataclass(frozen=True)
class Probe:
    """What this machine offers the checks."""

    cuda: bool
    device_count: int
    etcd: Optional[str]  # why no etcd server binary was found, or None if one was
    two_ranks: Optional[str] = "not probed"  # why NCCL refused two ranks on one GPU (preflight), or None


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
    # of "cuda", "etcd", "two-ranks" (NCCL took two ranks on one GPU in the preflight),
    # "no-cuda" (only where there is none), "named" (only when --only names it)
    needs: tuple[str, ...] = ("cuda",)


@dataclass
class Context:
    """Given to a check's ``run``: where to write, how long it has."""

    workdir: Path
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    facts: dict = field(default_factory=dict)  # what the preflight found (its figures)

    def left(self, margin: float = 3.0) -> float:
        return max(1.0, self.budget_s - (time.monotonic() - self.started) - margin)


def skip_reason(check: Check, probe: Probe) -> Optional[str]:
    """Why ``check`` cannot run on this machine, or None."""
    if "cuda" in check.needs and not probe.cuda:
        return "no CUDA here (a CPU build of torch, or no GPU visible)"
    if "etcd" in check.needs and probe.etcd is not None:
        return f"no etcd server binary: {probe.etcd}"
    if "two-ranks" in check.needs and probe.two_ranks is not None:
        return f"NCCL took no two ranks on one GPU in the preflight: {probe.two_ranks}"
    return None


def python_path(first: Sequence[str] = (), environ: Optional[Mapping[str, str]] = None) -> str:
    """``PYTHONPATH`` for a child: ``first``, then what ``environ`` has (the bundle's site
    folder), then the repository (for ``tests``) unless it is there already."""
    environ = os.environ if environ is None else environ
    entries = [*first, *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    if str(REPO) not in entries:
        entries.append(str(REPO))
    return os.pathsep.join(dict.fromkeys(entries))


def child_env(extra: Optional[dict] = None) -> dict:
    """A child's environment: the caller's ``PYTHONPATH`` extended with this repository
    (``python_path``), unbuffered output, one GPU, NCCL on the loopback (the review's
    section 4 prerequisites); ``extra`` wins, its ``PYTHONPATH`` entries go first."""
    extra = dict(extra or {})
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update(PYTHONUNBUFFERED="1")
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    first = [p for p in extra.pop("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(extra)
    env["PYTHONPATH"] = python_path(first)
    return env


def tagged(tag: str) -> list[int]:
    """The pids of the processes whose environment carries ``GPU_CHECK_TAG=tag`` (Linux)."""
    wanted = f"{TAG}={tag}".encode()
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if wanted in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def sweep(tag: str, rounds: int = 5) -> int:
    """SIGKILL every process still carrying ``tag`` (a check's agents, workers, NCCL
    children, in whatever session); how many were killed."""
    killed = 0
    for _ in range(rounds):
        pids = tagged(tag)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return killed


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


_batches = iter(range(1, 1 << 30))


def run_children(commands: Sequence[Sequence[str]], envs: Sequence[dict], timeout_s: float,
                 cwd: Optional[Path] = None) -> list[Child]:
    """Run the commands at once; wait for all of them at most ``timeout_s`` in total, then
    kill what is left (rc None). They stay in the caller's process group (a check killed
    at its budget takes them along), run in ``cwd`` (default: the current folder, the
    check's own), and write to files there, never to pipes (a chatty child, with
    ``NCCL_DEBUG=INFO`` say, would block on a full pipe); the files go into the logs."""
    folder = Path(cwd) if cwd is not None else Path.cwd()
    batch = next(_batches)
    procs, files = [], []
    for i, (cmd, env) in enumerate(zip(commands, envs)):
        out, err = folder / f"child-{batch}-{i}.out", folder / f"child-{batch}-{i}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            procs.append(subprocess.Popen(list(cmd), env=env, cwd=folder, stdout=fo, stderr=fe))
        files.append((out, err))
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
            proc.kill()
        proc.wait(30)
        out, err = (path.read_text(errors="replace") for path in files[i])
        children.append(Child(proc.returncode if i in ended else None, out, err, ended.get(i, time.time())))
    return children


def python_c(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]
