"""Which failures re-form the ring, which replace the worker and which fail the job,
and the one line a failure is logged as.

Three kinds (``classify``):

* a broken ring (a peer died, the network broke, the ring was aborted): the
  survivors re-form it in their running processes;
* a broken process (a sticky CUDA error: an Xid, an ECC error, an illegal address;
  a device that no longer answers; out of memory on this rank): this process cannot
  go on, a new one can. It exits with ``WORKER_BROKEN`` and its agent replaces it
  like a crash, within ``--max-restarts``;
* a bug in user code (anything else): the job fails, once, with its line.

Out of memory counts as a broken process: when one rank runs out while its peers
do not (fragmentation, a leak, a neighbour on the GPU), a fresh process on the same
GPU starts clean. When every rank runs out (the batch does not fit), every
replacement runs out again: each agent's ``--max-restarts`` runs out, and without
replacements the ring shrinks below ``--min-np`` and the job fails (after
``--rdzv-timeout``). That costs some restarts, but a worker cannot tell the two cases
apart alone, and counting the first as the user's would end jobs for one bad GPU.
A device-side assert is CUDA's report of a bug in user code (an index out of
range): every replacement would hit it again, so it stays a user error.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from ..contract.errors import BrokenProcess, HostsUpdatedInterrupt, LeftBehind, PeerDataInvalid, PeersUnreachable

RING, PROCESS, USER = "broken ring", "broken process", "user error"

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


def classify(exc: BaseException) -> str:
    """``RING``, ``PROCESS`` or ``USER``: what the failure ``exc`` asks for (see above)."""
    if isinstance(exc, (HostsUpdatedInterrupt, PeersUnreachable, LeftBehind, PeerDataInvalid)):
        return RING
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


def is_communication_error(exc: BaseException) -> bool:
    """A broken ring: re-form it."""
    return classify(exc) == RING


def is_broken_process(exc: BaseException) -> bool:
    """This process cannot go on (a sticky CUDA error): exit ``WORKER_BROKEN``, be replaced."""
    return classify(exc) == PROCESS


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
