"""This process's session: started by ``elastic.init()``, found by the user API.

The one process-wide object of the worker side lives here, below the user API that
reads it (``elastic.rank()``, ``State.commit()``, ``@elastic.run``), so nothing in
the worker room has to reach up into ``elastic/__init__.py`` for it. It is a
``WorkerSession`` (``session.py``): the recovery loop takes it once and hands each ring
to the states; ``State.commit()``, called from the user's loop, asks ``ring()``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import traceback
from typing import Optional

from elastic.rendezvous import RendezvousError

from ..contract.console import WorkerFormatter
from ..contract.errors import ElasticError, LeftJob
from ..contract.exit_codes import WORKER_BROKEN
from ..contract.faults import NETWORK, PROCESS, STORAGE, Fault
from ..contract.worker_config import WorkerConfig
from .failures import classify
from . import exit_record, pre_train, step_signals
from .ring_view import RingView
from .session import WorkerSession

_current: Optional[WorkerSession] = None


def start() -> None:
    """Join the job this worker was started for (a world of one without a launcher)."""
    global _current
    if _current is not None:
        return
    config = WorkerConfig.from_env()
    if config is None:  # not started by an agent: a world of one
        _configure_logging(marks=False)
        session = WorkerSession.alone()
    else:
        _configure_logging(marks=True)
        if config.error_file:
            _report_errors_to(config.error_file)
            atexit.register(exit_record.at_exit)  # runs after shutdown (atexit is last in, first out)
        step_signals.leave_sigterm_to_the_agent()  # Slurm signals the agent and its workers alike
        try:
            session = WorkerSession.join(config)
        except LeftJob as exc:
            print(f"elastic: {exc}; nothing to do", file=sys.stderr)
            raise SystemExit(0)
        except RendezvousError as exc:
            print(f"elastic: {exc}", file=sys.stderr)
            raise SystemExit(1)
    _current = session
    atexit.register(shutdown)


def install(session: Optional[WorkerSession]) -> None:
    """Make ``session`` this process's (tests: ``WorkerSession.serving(FakeRing(...))``)."""
    global _current
    _current = session


def current() -> WorkerSession:
    if _current is None:
        raise ElasticError("elastic.init() has not been called")
    return _current


def ring() -> RingView:
    """The ring this worker trains on now (``State.commit()`` asks it, once per commit)."""
    return current().ring


def shutdown() -> None:
    global _current
    if _current is not None:
        _current.shutdown()
        _current = None


def _configure_logging(*, marks: bool) -> None:
    # The runtime's packages log one line per event; user code's logging is left alone.
    # Lines keep their room's short name as prefix ("rendezvous: ..."), as before the
    # rooms moved under the elastic namespace.
    for name, prefix in (("elastic", "elastic"), ("elastic.checkpoint", "checkpoint"),
                         ("elastic.rendezvous", "rendezvous")):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            # Under an agent, the details of a failure go to the log file only (console.py).
            handler.setFormatter(WorkerFormatter(f"{prefix}: %(message)s", marks=marks))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO if prefix != "rendezvous" else logging.WARNING)
            logger.propagate = False


def exit_broken(fault: Fault) -> None:
    """This process cannot go on (failures.py: a broken process): say why in its exit
    record, and exit with ``WORKER_BROKEN`` at once, so that its agent replaces it. No
    clean-up: with a sticky CUDA error it could only hang or fail again."""
    exit_record.failed(fault)
    line = fault.reason
    # The process's own stderr: torch.distributed's excepthook runs ours with sys.stderr
    # swapped for a buffer that it prints only after we return, which we never do.
    print(f"elastic: broken process ({line}); exiting for its agent to replace it (within --max-restarts)",
          file=sys.__stderr__)
    sys.stdout.flush()
    sys.__stderr__.flush()
    os._exit(WORKER_BROKEN)


def _report_errors_to(path: str) -> None:
    """An uncaught exception ends this worker: leave its fault for the agent, which
    decides from it (agent/fate.py: a user error fails the job, a broken ring that
    escaped elastic.run is a crash to replace, ...)."""
    exit_record.report_to(path)
    previous = sys.excepthook

    def hook(kind, value, tb):
        explained = pre_train.explain(value, _current.joining_round if _current is not None else None)
        if explained is not value:
            # A joiner's collective before @elastic.run: the user's error, in the one line
            # that says where it is and what to do (pre_train.py); torch's frames add nothing.
            exit_record.failed(classify(explained))
            print(f"elastic: {type(explained).__name__}: {explained}", file=sys.stderr)
            return
        fault = classify(value)
        if fault.kind == PROCESS:
            traceback.print_exception(kind, value, tb, file=sys.__stderr__)  # for the log file
            exit_broken(fault)
        exit_record.failed(fault)
        if fault.kind in (NETWORK, STORAGE):
            # A fault of the network or the storage, not a crash and not a bug: one line,
            # no traceback that would read like a bug.
            print(f"elastic: {value}", file=sys.stderr)
            return
        previous(kind, value, tb)

    sys.excepthook = hook
