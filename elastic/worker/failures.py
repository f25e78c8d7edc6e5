"""Which failures re-form the ring and which fail the job: the line between a broken
ring and a bug in user code, and the one line a failure is logged as."""

from __future__ import annotations

import re

import torch.distributed as dist

from ..contract.errors import HostsUpdatedInterrupt, LeftBehind, PeersUnreachable


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
    if isinstance(exc, (HostsUpdatedInterrupt, PeersUnreachable, LeftBehind)):
        return True
    if isinstance(exc, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    if type(exc) is RuntimeError:
        text = str(exc).lower()
        return any(marker in text for marker in _COMMUNICATION_MARKERS)
    return False


# gloo starts its messages with the C++ source location and ends many with advice;
# neither tells a person what happened (the whole text stays in the worker's log).
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
_ADVICE = re.compile(r"\.?\s*This is typically caused by .*$")


def summarize(exc: BaseException) -> str:
    """One line naming the error, for logs and events (gloo messages span lines)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, PeersUnreachable):
        return first  # a whole sentence already, which says what went wrong in words
    first = _ADVICE.sub("", _SOURCE_LOCATION.sub("", first))
    return f"{type(exc).__name__}: {first[:300]}"
