"""What were the workers doing? Their stacks, for the message of a test that timed out.

A worker under ``elastic-run`` registers ``faulthandler`` for SIGUSR1, writing to a
file it keeps open (``elastic/contract/progress.py``); the agent uses it before it kills a hung
worker. A test that waited in vain uses it the same way: the file is found through
``/proc/<pid>/fd``, so the test needs only the pids (from the ``worker_started``
events), and asks as the agent does (``ask_stacks``). faulthandler writes without the
GIL, so even a process deadlocked while holding it shows every thread; the kernel's
state of each thread is added.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterable, Iterator

from elastic.agent.watchdog import ask_stacks


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
    files = {pid: path for pid in dict.fromkeys(pids) if (path := _stacks_file(pid)) is not None}
    dumps = ask_stacks({pid: (pid, path, True) for pid, path in files.items()}, timeout)
    parts = [f"--- worker pid {pid}, threads {_thread_states(pid)} ---\n{dumps[pid].strip() or '(no answer)'}"
             for pid in files]
    return "\n".join(parts) or "(no live worker with a stacks file)"


@contextlib.contextmanager
def stacks_on_timeout(pids: Callable[[], Iterable[int]]) -> Iterator[None]:
    """An AssertionError raised inside (a wait that timed out) carries the workers' stacks."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{worker_stacks(pids())}") from None
