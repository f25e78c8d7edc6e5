"""What were the workers doing? Their stacks, for the message of a test that timed out.

A worker under ``elastic-run`` registers ``faulthandler`` for SIGUSR1, writing to a
file it keeps open (``elastic/progress.py``); the agent uses it before it kills a hung
worker. A test that waited in vain uses it the same way: the file is found through
``/proc/<pid>/fd``, so the test needs only the pids (from the ``worker_started``
events). faulthandler writes without the GIL, so even a process deadlocked while
holding it shows every thread; the kernel's state of each thread is added.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Callable, Iterable, Iterator


def _stacks_file(pid: int) -> str | None:
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.endswith(".stacks"):
                return target
    except OSError:
        pass
    return None


def _thread_states(pid: int) -> str:
    states = []
    try:
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            states.append(f"{name}:{stat[stat.rindex(')') + 2:][:1]}")
    except (OSError, ValueError):
        pass
    return " ".join(states)


def worker_stacks(pids: Iterable[int], timeout: float = 3.0) -> str:
    """Each live worker's thread states and stacks (bounded by ``timeout`` in all)."""
    files = {}
    for pid in dict.fromkeys(pids):
        path = _stacks_file(pid)
        if path is None:
            continue
        files[pid] = (path, os.path.getsize(path))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(os.path.getsize(p) > size for p, size in files.values()):
        time.sleep(0.05)
    time.sleep(0.1)  # a dump that started is written in one go; let it end
    parts = []
    for pid, (path, size) in files.items():
        with open(path, errors="replace") as f:
            f.seek(size)
            dump = f.read().strip() or "(no answer)"
        parts.append(f"--- worker pid {pid}, threads {_thread_states(pid)} ---\n{dump}")
    return "\n".join(parts) or "(no live worker with a stacks file)"


@contextlib.contextmanager
def stacks_on_timeout(pids: Callable[[], Iterable[int]]) -> Iterator[None]:
    """An AssertionError raised inside (a wait that timed out) carries the workers' stacks."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{worker_stacks(pids())}") from None
