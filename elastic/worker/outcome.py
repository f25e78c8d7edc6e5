"""How one run of the training function ended, as one value the recovery loop reads.

``recovery.run`` calls the training function (after a sync) and gets one of:

    Finished(value)   it returned: the job's work is done on this worker
    Switch            the ring changes at a commit (a join, a graceful leave): nothing rolled back
    Stop              the job was told to stop: every worker stops at the same commit
    Leave             this worker is no longer part of the job (withdrawn, the job over)
    Broken(fault)     the ring broke: roll back to the last commit and re-form

The exception that ended the call does not outlive ``outcome_of``: a live traceback
keeps the old process group's sockets open. Anything that is neither a ring fault
nor one of the four interruptions is raised on (the user's bug, a broken process):
``lifecycle.py`` reports it to the agent.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from ..contract.console import FILE_ONLY
from ..contract.errors import HostsUpdatedInterrupt, JobStopping, LeftJob, PeerDataInvalid, PeersUnreachable
from ..contract.faults import NETWORK, Fault
from .failures import classify_in_window

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    value: Any


@dataclass(frozen=True)
class Switch:
    reason: str
    detected: float = field(default_factory=time.monotonic)
    failed = False  # a planned change: the new ring goes on from this commit


@dataclass(frozen=True)
class Stop:
    reason: str


@dataclass(frozen=True)
class Leave:
    reason: str


@dataclass(frozen=True)
class Broken:
    fault: Fault
    detected: float = field(default_factory=time.monotonic)
    unreachable: Optional[PeersUnreachable] = None  # the peers could not connect (no traceback kept)
    alone: bool = False  # a fault only this worker saw (a peer's or the store's bad value)
    failed = True  # roll back to the last commit

    @property
    def reason(self) -> str:
        return self.fault.reason


Outcome = Union[Finished, Switch, Stop, Leave, Broken]


class TrainingFinished(Exception):
    """A worker that waited outside the training function (a hybrid mesh's spare,
    elastic/sharded/spares.py) learns that the ring's training function returned: it
    has finished too, without running the function."""


def outcome_of(ring_broken: Callable[[], Optional[str]], body: Callable[..., Any], *args) -> Outcome:
    """Call ``body(*args)``; its value, or the interruption that ended it, as an ``Outcome``.
    ``ring_broken()``: why the ring ``body`` ran on is broken, or None (``Ring.broken_reason``)."""
    try:
        return Finished(body(*args))
    except TrainingFinished:
        return Finished(None)
    except JobStopping as exc:
        return Stop(str(exc))
    except HostsUpdatedInterrupt as exc:
        return Switch(str(exc))
    except LeftJob as exc:
        return Leave(str(exc))
    except Exception as exc:
        broken = broken_by(exc, ring_broken())
        if broken is None:
            raise  # this worker fails (a bug in user code, a broken process): lifecycle.py reports it
        # The whole text (gloo's spans lines) for the log file; reform_done is the console's line.
        whole = broken.reason if broken.fault.kind == NETWORK else f"{type(exc).__name__}: {str(exc).strip()}"
        log.warning("ring broken: %s", whole, extra=FILE_ONLY)
        return broken


def broken_by(exc: BaseException, ring_broken: Optional[str] = None) -> Optional[Broken]:
    """``exc`` as a broken ring, or None when the ring does not re-form for it
    (``ring_broken``: why the ring was broken meanwhile: failures.classify_in_window)."""
    fault = classify_in_window(exc, ring_broken)
    if not fault.reforms:
        return None
    return Broken(fault, unreachable=exc.detached() if isinstance(exc, PeersUnreachable) else None,
                  alone=isinstance(exc, PeerDataInvalid))
