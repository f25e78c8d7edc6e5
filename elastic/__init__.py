"""Elastic data-parallel training: the in-worker API.

    import elastic
    elastic.init()
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @elastic.run
    def train(state): ...          # re-entered after every re-formation of the ring
"""

from __future__ import annotations

import atexit
import logging
import sys
from typing import Optional

from rendezvous import RendezvousError

from .console import WorkerFormatter
from .errors import ElasticError, LeftJob, HostsUpdatedInterrupt, PeersUnreachable, ResetLimitExceeded, is_communication_error, summarize
from .recovery import run
from .runtime import Runtime
from .global_batch import accumulate
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState
from .worker_config import WorkerConfig

__all__ = [
    "ElasticError", "ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "ResetLimitExceeded",
    "State", "TorchState", "accumulate", "init", "local_rank", "rank", "round", "run", "shutdown", "size",
]

_current: Optional[Runtime] = None


def init() -> None:
    """Join the job this worker was started for (a world of one without a launcher)."""
    global _current
    if _current is not None:
        return
    config = WorkerConfig.from_env()
    _configure_logging(marks=config is not None)
    if config is not None and config.error_file:
        _report_errors_to(config.error_file)
    runtime = Runtime(config)
    try:
        runtime.start()
    except LeftJob as exc:
        print(f"elastic: {exc}; nothing to do", file=sys.stderr)
        raise SystemExit(0)
    except RendezvousError as exc:
        print(f"elastic: {exc}", file=sys.stderr)
        raise SystemExit(1)
    _current = runtime
    atexit.register(shutdown)


def shutdown() -> None:
    global _current
    if _current is not None:
        _current.shutdown()
        _current = None


def _runtime() -> Runtime:
    if _current is None:
        raise ElasticError("elastic.init() has not been called")
    return _current


def rank() -> int:
    return _runtime().rank


def size() -> int:
    return _runtime().world_size


def local_rank() -> int:
    return _runtime().local_rank


def round() -> int:  # noqa: A001 - mirrors the event field name
    return _runtime().round


def _configure_logging(*, marks: bool) -> None:
    # The runtime's packages log one line per event; user code's logging is left alone.
    for name in ("elastic", "checkpoint", "rendezvous"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            # Under an agent, the details of a failure go to the log file only (console.py).
            handler.setFormatter(WorkerFormatter(f"{name}: %(message)s", marks=marks))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO if name != "rendezvous" else logging.WARNING)
            logger.propagate = False


def _report_errors_to(path: str) -> None:
    """An uncaught exception is a user error: leave a one-line report for the agent."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, PeersUnreachable):
            # A network fault, not a crash and not a bug: one line, and its own kind
            # of report, so the agent neither fails the job nor drops this worker.
            with open(path, "w") as f:
                f.write(PeersUnreachable.REPORT_PREFIX + str(value) + "\n")
            print(f"elastic: {value}", file=sys.stderr)
            return
        try:
            # A broken ring or an unreachable etcd that escaped elastic.run is a
            # crash, not a user error: the agent then drops this worker and the
            # others re-form, instead of failing the whole job.
            if not (is_communication_error(value) or isinstance(value, RendezvousError)):
                with open(path, "w") as f:
                    f.write(summarize(value) + "\n")
        finally:
            previous(kind, value, tb)

    sys.excepthook = hook
