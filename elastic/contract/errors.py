"""Errors of the in-worker runtime, and the line between a broken ring and a bug."""

from __future__ import annotations

import re

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


class PeersUnreachable(ElasticError):
    """The workers of a round could not connect to each other (a wrong ``--host-addr``,
    an interface gloo cannot use, a firewall). A fault of the network, not of a worker:
    the agent must not count it as a crash (see ``agent.py``, ``_on_network_failure``)."""

    # How a worker's one-line report names this kind to its agent (error file).
    REPORT_PREFIX = "peers unreachable: "

    def __init__(self, round_number: int, addresses: list[str], cause: str):
        self.round = round_number
        self.addresses = addresses
        self.cause = cause
        super().__init__(
            f"round {round_number}: workers could not connect to each other at {', '.join(addresses)} "
            f"({cause}); check --host-addr, GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME and firewalls"
        )


    def detached(self) -> "PeersUnreachable":
        """The same error without traceback or context, which would pin the half-built
        process group's frames (see ``recovery.py``)."""
        return PeersUnreachable(self.round, self.addresses, self.cause)


class LeftBehind(ElasticError):
    """Raised by ``state.commit()`` in a worker whose round the job left without it (a
    later plan declared it lost: its host was paused or cut off past the TTL). Its
    ring is gone: a ring failure, after which it joins the job again (commit_fence.py)."""


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
