"""First code a worker runs: tie its life to the agent's, then run the user's script.

``python -m elastic.worker.bootstrap SCRIPT ARGS`` (or ``-m MODULE ARGS``): a fresh start.
A warm start (``template.py``) forks from a process that has imported torch already and
then runs the same two steps. The parent-death signal is set here, after exec, rather
than in a ``preexec_fn``: forking a process that runs gRPC threads and then running
Python before exec crashes the child.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL when our parent (the agent, or the template it forked us from) ends."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before we could ask
        os._exit(1)


def run_script(args: list[str]) -> None:
    """Run ``SCRIPT ARGS`` or ``-m MODULE ARGS`` as ``__main__``, as ``python`` would."""
    if args[:1] == ["-m"]:
        sys.argv = args[1:]
        sys.path[0] = os.getcwd()  # python -m puts the working directory first
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def main() -> None:
    agent = os.environ.get("ELASTIC_WORKER_AGENT_PID")
    if agent:
        die_with_parent(int(agent))
    run_script(sys.argv[1:])


if __name__ == "__main__":
    main()
