"""First code a worker runs: tie its life to the agent's, then run the user's script.

``python -m elastic.worker.bootstrap SCRIPT ARGS`` (or ``-m MODULE ARGS``). The parent-death
signal is set here, after exec, rather than in a ``preexec_fn``: forking a process
that runs gRPC threads and then running Python before exec crashes the child.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_agent(agent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != agent_pid:  # the agent died before we could ask
        os._exit(1)


def main() -> None:
    agent = os.environ.get("ELASTIC_WORKER_AGENT_PID")
    if agent:
        _die_with_agent(int(agent))
    args = sys.argv[1:]
    if args[:1] == ["-m"]:
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
