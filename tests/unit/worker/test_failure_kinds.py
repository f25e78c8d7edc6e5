"""Three kinds of failure, as a table of real exception objects: ring, process, user."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from elastic.contract.errors import BrokenProcess, HostsUpdatedInterrupt, LeftBehind, PeerDataInvalid, PeersUnreachable
from elastic.worker.failures import PROCESS, RING, USER, classify, is_broken_process, is_communication_error

CASES = [
    # -- a broken process: its agent replaces it
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), PROCESS),
    (torch.AcceleratorError("CUDA error: uncorrectable ECC error encountered"), PROCESS),
    (torch.AcceleratorError("CUDA error: unspecified launch failure"), PROCESS),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), PROCESS),
    (RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be ..."), PROCESS),
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
                           "NCCL_DEBUG=INFO for details)"), PROCESS),
    (RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable"), PROCESS),
    (BrokenProcess("device health check: cuda:0 did not finish its queued work within 60s"), PROCESS),
    # -- a broken ring: re-form it
    (dist.DistBackendError("NCCL error: remote process exited or there was a network error"), RING),
    (dist.DistNetworkError("Connection reset by peer"), RING),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"),
     RING),
    (RuntimeError("Timed out waiting 60000ms for send operation to complete"), RING),
    (HostsUpdatedInterrupt("round 3"), RING),
    (LeftBehind("left behind"), RING),
    (PeerDataInvalid("round 3: the layout from rank 0 is malformed"), RING),
    (PeersUnreachable(2, ["10.0.0.1"], "connect"), RING),
    # -- a bug in user code: the job fails
    (torch.AcceleratorError("CUDA error: device-side assert triggered"), USER),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"), USER),
    (ValueError("bad batch at step 7"), USER),
    (KeyError("nccl"), USER),  # a marker word in a non-RuntimeError changes nothing
    (RuntimeError("Default process group has not been initialized, please make sure to call "
                  "init_process_group."), USER),
    (RuntimeError("No backend type associated with device type cpu"), USER),
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN "
                           "for details)"), USER),
    (RuntimeError("Tensors must be CUDA and dense"), USER),
]


@pytest.mark.parametrize("exc, kind", CASES, ids=[f"{type(e).__name__}:{str(e)[:40]}" for e, _ in CASES])
def test_classify(exc, kind):
    assert classify(exc) == kind
    assert is_communication_error(exc) == (kind == RING)
    assert is_broken_process(exc) == (kind == PROCESS)


def test_raised_from_user_code_with_a_traceback_too():
    def step():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    with pytest.raises(torch.OutOfMemoryError) as caught:
        step()
    assert classify(caught.value) == PROCESS
