"""What a failure means: the one classifier of every exception a worker meets, and the
one line a failure is logged as.

``classify`` turns an exception into a ``Fault`` (``contract/faults.py``); every catch
site of the worker (``recovery.py``, ``lifecycle.py``'s excepthook, ``ring_entry.py``
around ``init_process_group``, the Horovod ops) asks it and adds no rule of its own.
The kinds:

* a broken ring (a peer died, the network broke, the ring was aborted, etcd or the
  round's store failed us): the survivors re-form it in their running processes;
* peers unreachable (the round's workers could not connect to each other: an
  address, a firewall): a fault of the network, for which the agent asks another round;
* a broken process (a sticky CUDA error: an Xid, an ECC error, an illegal address;
  a device that no longer answers; out of memory on this rank): this process cannot
  go on, a new one can. It exits with ``WORKER_BROKEN`` and its agent replaces it
  like a crash, within ``--max-restarts``;
* a bug in user code (anything else): the job fails, once, with its line;
* the reset budget used up (``ResetLimitExceeded``): the job fails, not as the user's.

Out of memory counts as a broken process: when one rank runs out while its peers
do not (fragmentation, a leak, a neighbour on the GPU), a fresh process on the same
GPU starts clean. When every rank runs out (the batch does not fit), every
replacement would run out again. A worker cannot tell the two cases
apart alone, and counting the first as the user's would end jobs for one bad GPU; the
agent can: the same fault on all of its workers, or again on a replacement, fails the
job (``agent/fate.py``).

A device-side assert is CUDA's report of a bug in user code (an index out of
range): every replacement would hit it again, so it stays a user error.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist

from elastic.checkpoint import CheckpointsUnreadable
from elastic.rendezvous import RendezvousError

from ..contract.errors import (
    BrokenProcess,
    HostsUpdatedInterrupt,
    LeftBehind,
    PeerDataInvalid,
    PeersUnreachable,
    ResetLimitExceeded,
)
from ..contract.faults import BUDGET, NETWORK, PROCESS, RING, STORAGE, USER, Fault

# Lower-case parts of the messages of CUDA errors after which the process's CUDA context
# is unusable (sticky errors), as torch and NCCL ("unhandled cuda error") word them.
_BROKEN_PROCESS_MARKERS = (
    "unhandled cuda error",
    "illegal memory access",
    "illegal instruction",
    "misaligned address",
    "uncorrectable ecc error",
    "uncorrectable nvlink error",
    "unspecified launch failure",
    "cuda error: unknown error",
    "cuda error: launch failure",
    "gpu has fallen off the bus",
    "cuda out of memory",
    "busy or unavailable",  # a device still held by the process before us
)
# CUDA errors that are the user's code: a fresh process would hit them again.
_USER_CUDA_MARKERS = ("device-side assert",)
# Messages from torch.distributed that name a misuse, not a fault: they contain the
# words below ("process group", "nccl") but re-forming would only meet them again.
_USER_MISUSE_MARKERS = (
    "has not been initialized",  # a collective before elastic.init()
    "no backend type associated with device type",  # a CPU tensor on an NCCL-only group
    "invalid usage",  # ncclInvalidUsage: mismatched collectives or arguments
    "tensors must be",  # "Tensors must be CUDA and dense", "... contiguous"
)


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


def classify(exc: BaseException) -> Fault:
    """What the failure ``exc`` means (see above), with its one line."""
    return Fault(kind_of(exc), summarize(exc))


def classify_in_window(exc: BaseException, ring_broken: Optional[str]) -> Fault:
    """``classify(exc)`` for an exception of the training function, knowing whether its
    ring was broken meanwhile (``ring_broken``: why, or None). Between an NCCL abort and
    the next collective user code runs on corrupted weights (the queued optimizer step
    applied partial gradients): a NaN guard or an assert that raises there is no bug of
    the user's. The rollback discards those weights anyway, so such an error re-forms
    the ring. A broken process stays one: its device is gone too."""
    fault = classify(exc)
    if ring_broken is None or fault.kind != USER:
        return fault
    return Fault(RING, f"{fault.reason} (after the ring broke: {ring_broken})"[:400])


def broken_process(why: str) -> Fault:
    """The worker's own process cannot go on (an NCCL abort past its deadline, a device
    that does not answer): its agent replaces it."""
    return Fault(PROCESS, why)


def classify_init(exc: BaseException, *, peer_lost: bool) -> Fault:
    """What a failed ``init_process_group`` of a new round means. A broken ring while
    every worker of the round reached its store and none was declared lost means the
    workers could not reach each other: the network, not a dead peer."""
    fault = classify(exc)
    if fault.kind == RING and not peer_lost:
        return Fault(NETWORK, fault.reason)
    return fault


def kind_of(exc: BaseException) -> str:
    """The kind of ``classify(exc)``, without its line."""
    if isinstance(exc, PeersUnreachable):
        return NETWORK
    if isinstance(exc, ResetLimitExceeded):
        return BUDGET
    if isinstance(exc, CheckpointsUnreadable):
        return STORAGE  # a run later may pass: not the user's error
    if isinstance(exc, (HostsUpdatedInterrupt, LeftBehind, RendezvousError, PeerDataInvalid)):
        return RING  # PeerDataInvalid: a peer's bad data re-forms the ring without it
    if isinstance(exc, BrokenProcess):
        return PROCESS
    if not isinstance(exc, RuntimeError):
        return USER
    text = str(exc).lower()
    if any(marker in text for marker in _USER_CUDA_MARKERS):
        return USER
    if isinstance(exc, (torch.AcceleratorError, torch.OutOfMemoryError)):
        return PROCESS
    if any(marker in text for marker in _BROKEN_PROCESS_MARKERS):
        return PROCESS  # NCCL's "unhandled cuda error" is a DistBackendError: checked first
    if any(marker in text for marker in _USER_MISUSE_MARKERS):
        return USER
    if isinstance(exc, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return RING
    if type(exc) is RuntimeError and any(marker in text for marker in _COMMUNICATION_MARKERS):
        return RING
    return USER


# gloo starts its messages with the C++ source location and ends many with advice;
# neither tells a person what happened (the whole text stays in the worker's log).
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
_ADVICE = re.compile(r"\.?\s*This is typically caused by .*$")


def summarize(exc: BaseException) -> str:
    """One line naming the error, for logs and events (gloo messages span lines)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, PeersUnreachable):
        return first  # a whole sentence already, which says what went wrong in words
    if isinstance(exc, CheckpointsUnreadable):
        return f"{type(exc).__name__}: {first}"  # our own line: its advice comes last, never cut
    first = _ADVICE.sub("", _SOURCE_LOCATION.sub("", first))
    return f"{type(exc).__name__}: {first[:300]}"
