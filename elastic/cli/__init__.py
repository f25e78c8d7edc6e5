"""``elastic-run`` and its subcommands: the only place that reads argv.

    launch.py     elastic-run [options] SCRIPT: start or join a job (runs this host's agent)
    status.py     elastic-run status: what a job is doing, from etcd alone
    timeline.py   elastic-run timeline LOG_DIR -o FILE.png: a picture of what a job did
    (checkpoints) elastic-run checkpoints DIR: checkpoint/cli.py, also ``python -m checkpoint``
    options.py    the options several commands share, and their environment forms

May import the agent, the contract, the timeline model, ``rendezvous`` and ``checkpoint``;
never the worker runtime (a command runs no training).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``elastic-run`` entry point: a subcommand, else the launcher."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Each command is imported only when asked for: `status` needs no agent.
    if argv[:1] == ["checkpoints"]:
        from elastic.checkpoint.cli import main as checkpoints

        return checkpoints(argv[1:])
    if argv[:1] == ["status"]:
        from .status import main as status

        return status(argv[1:])
    if argv[:1] == ["timeline"]:
        from .timeline import main as timeline

        return timeline(argv[1:])
    from .launch import main as launch

    return launch(argv)
