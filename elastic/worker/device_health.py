"""Is this worker's GPU still answering? A bounded device sync before it rejoins a ring.

After a failure the process may hold a broken CUDA context (a sticky error) or a
device that never finishes its queued work (a hung kernel, a driver in trouble).
Joining the next ring with it would break that ring too, or hang it. So before a
worker re-forms on CUDA it waits for its device to finish everything queued, in a
thread, for a bounded time (NVIDIA's in-process restart does the same in its
CudaHealthCheck): a CUDA error raised by the sync is a broken process
(failures.py), and a sync still running past the bound is one too.

The sync names this worker's own device (its slot). CUDA's current device is per host
thread and a new thread starts on device 0, so a bare ``torch.cuda.synchronize()`` in
the checking thread would sync GPU 0: nothing for the workers of slots 1-7, and a CUDA
context of theirs left on GPU 0 (gpu review G1). The caller aborts the old ring first:
a kernel of it waiting for a dead peer would otherwise hold the sync to its bound.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import torch

from ..contract.devices import uses_nccl
from ..contract.errors import BrokenProcess

log = logging.getLogger(__name__)


def bounded(call: Callable[[], object], timeout_s: float) -> bool:
    """Run ``call`` in a daemon thread: True once it has returned, False if it is still
    running after ``timeout_s`` (it is left running: a hung sync cannot be cancelled).
    An exception of ``call`` is raised here."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="device-health", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False
    if failure:
        raise failure[0]
    return True


def check_device(backend: str, timeout_s: float, *, slot: Optional[int] = None,
                 synchronize: Optional[Callable[[torch.device], object]] = None,
                 cuda_available: Optional[Callable[[], bool]] = None) -> Optional[float]:
    """Raise ``BrokenProcess`` unless this worker's device (``slot``; default: the calling
    thread's current device) finishes its queued work within ``timeout_s``; the seconds it
    took, or None without CUDA (nothing to check). ``synchronize(device)``: tests' fake."""
    available = cuda_available or torch.cuda.is_available
    if not uses_nccl(backend) or not available():
        return None
    # Read here, on the caller's thread (set_device'd to the slot), never in the sync's thread.
    device = torch.device("cuda", torch.cuda.current_device() if slot is None else slot)
    sync = synchronize or torch.cuda.synchronize
    started = time.monotonic()
    if not bounded(lambda: sync(device), timeout_s):
        raise BrokenProcess(f"device health check: {device} did not finish its queued work within {timeout_s:g}s")
    took = time.monotonic() - started
    log.debug("device health check: %.3fs", took)
    return took
