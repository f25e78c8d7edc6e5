"""A worker under elastic-run leaves SIGTERM to its agent: Slurm signals every process of a step.

On Kubernetes only the container's first process (elastic-run) gets SIGTERM; under
Slurm, ``scancel --signal=TERM``, preemption and the end of a job signal every process
the step tracks (proctrack/cgroup, proctrack/linuxproc), the workers included. A
worker dying of it mid-step would turn the agent's graceful leave into a crash:
its peers roll back to the last commit. So a worker of the elastic API takes no
action on SIGTERM: its agent got the same signal and withdraws it at the next
commit, after which it exits 0. The agent never stops an elastic worker with SIGTERM
(SIGKILL only), and if the agent dies the worker gets SIGKILL (bootstrap.py), so
nothing is left running. A Python handler, not SIG_IGN: an ignored signal would stay
ignored in every program the worker executes.
"""

from __future__ import annotations

import signal
import sys
import threading

_told = threading.Event()


def _leave_it_to_the_agent(signum, _frame) -> None:
    if not _told.is_set():
        _told.set()
        print("elastic: SIGTERM left to the agent: this worker leaves at the next commit", file=sys.stderr)


def leave_sigterm_to_the_agent() -> None:
    """Called once a worker started by an agent joins (lifecycle.start); main thread only."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _leave_it_to_the_agent)
