"""``elastic-run`` and its subcommands: the only place that reads argv.

    launch.py     elastic-run [options] SCRIPT: start or join a job (runs this host's agent)
    status.py     elastic-run status: what a job is doing, from etcd alone
    timeline.py   elastic-run timeline LOG_DIR -o FILE.png: a picture of what a job did
    (checkpoints) elastic-run checkpoints DIR: checkpoint/cli.py, also ``python -m elastic.checkpoint``
    options.py    the options several commands share, and their environment forms
    torchrun.py   torchrun's spellings (--nnodes, --rdzv-id, ...) translated or refused
    horovodrun.py horovodrun's spellings (-np, --reset-limit, python ...) translated or refused
    join_hint.py  the command the launcher prints for joining its job

May import the agent, the contract, the timeline model, ``rendezvous`` and ``checkpoint``;
never the worker runtime (a command runs no training).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``elastic-run`` entry point: a subcommand, else the launcher."""
    entry_point = argv is None  # the console script or `python -m elastic.cli`
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

    code = launch(argv)
    if entry_point:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the launcher's process once everything is said and stopped.

    The agent is done (its workers reaped, its lease revoked, the embedded etcd stopped);
    what is left is the interpreter tearing down gRPC's channels and threads, 0.35 s of
    every start-to-exit on a 2-core host. Only as the process's entry point: a caller
    that runs ``main(argv)`` in its own process gets the status back.
    """
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
