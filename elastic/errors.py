"""Errors of the in-worker runtime, and the line between a broken ring and a bug."""

from __future__ import annotations

import torch.distributed as dist


class ElasticError(Exception):
    """Base of the runtime's own errors."""


class HostsUpdatedInterrupt(ElasticError):
    """Raised by ``state.commit()`` when the ring is about to change membership.

    Every worker of the round raises it at the same commit, so nothing committed
    is lost and nothing needs restoring: the new ring just syncs from rank 0.
    """


class JobStopping(ElasticError):
    """Raised by ``state.commit()`` on every worker at the same commit when the job
    was told to stop (SIGTERM/SIGINT that leaves too few workers to go on)."""


class ResetLimitExceeded(ElasticError):
    """More re-formations than ``--max-resets``: something keeps breaking the ring."""


class LeftJob(ElasticError):
    """This worker is no longer part of the job (graceful leave, or the job ended)."""


# Substrings of the RuntimeError messages gloo, NCCL and the c10d store produce when
# a peer dies, hangs or the network breaks. A user bug (shape mismatch, ValueError)
# does not match these and must not trigger a re-formation.
_COMMUNICATION_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "gloo",
    "nccl",
    "socket",
    "connection refused",
    "connect",
    "process group",
    "processgroup",
    "no route to host",
    "read error",
    "write error",
)


def is_communication_error(exc: BaseException) -> bool:
    if isinstance(exc, HostsUpdatedInterrupt):
        return True
    if isinstance(exc, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    if type(exc) is RuntimeError:
        text = str(exc).lower()
        return any(marker in text for marker in _COMMUNICATION_MARKERS)
    return False


def summarize(exc: BaseException) -> str:
    """One line naming the error, for logs and events (gloo messages span lines)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:300]}"
