"""The runtime's errors: raised in a worker, caught by user code or reported to the agent.

Which exception means a broken ring and which a bug is decided once, in the worker room
(``elastic/worker/failures.py classify``), and carried as a ``Fault`` (``faults.py``).
"""

from __future__ import annotations


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
    ring is gone: a ring failure, after which it joins the job again (left_behind.py)."""


class PeerDataInvalid(ElasticError):
    """A value that a peer of the ring or the round's store gave is malformed or impossible
    (a layout that does not parse, a commit newer than the ring's history allows, a
    switch decision for a commit already passed). It came from another process, so it is never
    the user's bug: a ring failure, after which the ring re-forms (within --max-resets)."""


class BrokenProcess(ElasticError):
    """This process cannot go on, though the ring could: its device no longer answers (a
    health check that timed out). It exits with ``WORKER_BROKEN``; its agent replaces it."""


class LeftJob(ElasticError):
    """This worker is no longer part of the job (graceful leave, or the job ended)."""
