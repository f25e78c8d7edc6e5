"""Connecting to a round's store without hanging on a dead or paused one.

A round's store is the TCPStore that its rank 0's agent serves. That agent may be
gone (a lost host: its port refuses, or, cut off, never answers the SYN) or stopped
(a paused VM, SIGSTOP: its listening socket stays open and the kernel completes the
TCP handshake for it). Either way a newer plan without it follows, and the worker
must notice it: so connect in short attempts, and ask between them whether the
round was superseded.

torch's client constructor honours its timeout while it connects, but once the TCP
connection is up it waits for the server's answer to its handshake without any
bound (torch 2.13, measured: a listening socket that is never accepted kept the
constructor blocked for minutes). So each attempt runs in a helper thread; past the
attempt's deadline, the connection it opened is shut down, which fails the
handshake and ends the thread (the same lever as ring_abort.py).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Callable

import torch.distributed as dist

from elastic.rendezvous.errors import RendezvousTimeoutError

from ..contract import round_keys
from ..contract.console import FILE_ONLY
from .ring_abort import shutdown_connections_to, socket_snapshot

log = logging.getLogger(__name__)

_ARRIVAL_POLL = 0.005  # seconds between looks at the arrival counter
_ARRIVAL_REPORT_S = 30.0  # a wait at the round's store this long is logged (then 60 s, 120 s, ...)
ATTEMPT_S = 1.0  # one connect attempt; between two, the caller looks at the plan again
_MIN_ATTEMPT_S = 0.1  # an attempt that fails at once (no route) is spaced out this much


class StoreUnanswered(RuntimeError):
    """The store accepted the connection but did not answer within the attempt."""


def client(host: str, port: int, timeout_s: float = ATTEMPT_S):
    """A TCPStore client of ``host:port`` within about ``timeout_s``, or an exception."""
    before = socket_snapshot()
    outcome: dict = {}

    def connect() -> None:
        try:
            outcome["store"] = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                             timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # (RuntimeError, DistError): reported below, as a value
            outcome["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"

    thread = threading.Thread(target=connect, name=f"store-connect:{port}", daemon=True)
    thread.start()
    # The constructor's own timeout covers the connect; the margin is for a loaded host.
    thread.join(timeout_s + 0.5)
    if thread.is_alive():
        # Connected, no answer: wake the handshake. Only connections to this port that
        # appeared since ``before`` are touched (the store's client is one of them).
        shutdown_connections_to(before, port)
        thread.join(timeout_s)
        raise StoreUnanswered(f"store {host}:{port} accepted the connection but did not answer within {timeout_s:g}s")
    if "store" not in outcome:
        raise RuntimeError(outcome.get("error", "store client failed"))
    return outcome["store"]


def connect(store_addr: str, *, round_number: int, overall_s: float, op_timeout_s: float,
            superseded: Callable[[], bool]):
    """The store at ``store_addr``, or None once ``superseded()`` says a newer round
    replaces this one; RendezvousTimeoutError after ``overall_s`` (--rdzv-timeout).
    The client's operations then time out after ``op_timeout_s``."""
    host, port = store_addr.rsplit(":", 1)
    deadline = time.monotonic() + overall_s
    while True:
        started = time.monotonic()
        try:
            base = client(host, int(port))
        except RuntimeError as exc:  # DistError is one; StoreUnanswered too
            if superseded():
                return None
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"round {round_number}: store {store_addr} unreachable for {overall_s:g}s ({exc})"
                ) from None
            time.sleep(max(0.0, _MIN_ATTEMPT_S - (time.monotonic() - started)))
            continue
        base.set_timeout(datetime.timedelta(seconds=op_timeout_s))
        return base


def arrive(store, plan, *, timeout_s: float, superseded: Callable[[], bool]) -> bool:
    """Wait until every worker of ``plan`` has arrived at its store; False if superseded.

    Whether the round forms or is abandoned for a newer one is decided once, for
    everybody, by a compare-and-set on the round's store: a worker that saw every
    arrival and one that saw a newer plan can race (a loss round is often followed
    at once by the round that admits a replacement), and a round that some join
    while others leave would block its joiners until the collective timeout.
    """
    store.add(round_keys.ARRIVED, 1)
    started = time.monotonic()
    deadline, report_after = started + timeout_s, _ARRIVAL_REPORT_S
    while True:
        arrived = store.add(round_keys.ARRIVED, 0)
        if arrived >= plan.world_size:
            return _settle_round(store, "formed") == "formed"
        if superseded():
            return _settle_round(store, "abandoned") == "formed"
        now = time.monotonic()
        if now - started > report_after:  # a long wait, in the log file: who is here, since when
            report_after *= 2
            log.info("round %d: %d of %d workers at the store after %.0fs; waiting for the rest", plan.round,
                     arrived, plan.world_size, now - started, extra=FILE_ONLY)
        if now > deadline:
            raise RendezvousTimeoutError(f"round {plan.round}: not every worker arrived within {timeout_s:g}s")
        time.sleep(_ARRIVAL_POLL)


def _settle_round(store, outcome: str) -> str:
    """The round's outcome: ours if nobody settled it yet, else the one already set."""
    value = store.compare_set(round_keys.OUTCOME, "", outcome)
    return value.decode() if isinstance(value, bytes) else str(value)


DUMP_SIGNAL_KEY = round_keys.DUMP_SIGNAL


def clear_dump_signal(base, round_number: int) -> bool:
    """Delete a stale dump signal from the job-wide store ``base`` before this process
    forms its next group; True if one was there.

    With dumps on (a user's TORCH_NCCL_DUMP_ON_TIMEOUT=1), the first NCCL group of every
    later process (a replacement, a joiner) polls the key, sees it within a second,
    dumps, sleeps TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC and SIGABRTs itself (docs/gpus.md).
    The key was written about a ring that is gone: this round starts clean. Every worker
    clears it before its own init, so no process's first group can read an old one;
    a timeout seen in this round writes it afresh. A store that refuses is no reason to
    stop entering the round (the key only matters with dumps on)."""
    try:
        cleared = bool(base.delete_key(DUMP_SIGNAL_KEY))
    except Exception as exc:  # noqa: BLE001 - DistStoreError, a store going away
        log.debug("could not clear %s from the job's store: %s", DUMP_SIGNAL_KEY, exc)
        return False
    if cleared:
        log.info("round %d: cleared a stale NCCL dump signal (%s) from the job's store", round_number,
                 DUMP_SIGNAL_KEY, extra=FILE_ONLY)
    return cleared
