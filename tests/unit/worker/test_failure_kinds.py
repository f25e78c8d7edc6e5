"""What each failure means, as a table of real exception objects: ring, network, process,
user, budget; the one classifier every catch site of the worker asks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from elastic.contract.errors import (
    BrokenProcess,
    HostsUpdatedInterrupt,
    JobStopping,
    LeftBehind,
    LeftJob,
    PeerDataInvalid,
    PeersUnreachable,
    ResetLimitExceeded,
)
from elastic.contract.faults import BUDGET, NETWORK, PROCESS, RING, USER, Fault
from elastic.worker.failures import classify, classify_init, kind_of
from elastic.rendezvous import RendezvousError
from elastic.rendezvous.errors import RendezvousConnectionError, RendezvousTimeoutError

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
    (RendezvousConnectionError("etcd at 10.0.0.5:2379 unreachable"), RING),  # etcd away while re-forming
    (RendezvousTimeoutError("round 4: no plan within 30s"), RING),
    (RendezvousError("round 4 superseded"), RING),
    # -- the round's workers could not connect to each other: the network
    (PeersUnreachable(2, ["10.0.0.1"], "connect"), NETWORK),
    # -- the ring kept breaking beyond --max-resets: the job fails, not as the user's error
    (ResetLimitExceeded("ring re-formed 3 times within 600s"), BUDGET),
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
    # The runtime's control flow, if it ever escapes @elastic.run, ends the worker as an error.
    (JobStopping("stop at commit 5"), USER),
    (LeftJob("withdrawn"), USER),
    # Out of memory raised by user code on a CPU run: the same kind as on a GPU.
    (torch.OutOfMemoryError("out of memory at step 7"), PROCESS),
]


@pytest.mark.parametrize("exc, kind", CASES, ids=[f"{type(e).__name__}:{str(e)[:40]}" for e, _ in CASES])
def test_classify(exc, kind):
    fault = classify(exc)
    assert fault.kind == kind_of(exc) == kind
    assert fault.reforms == (kind in (RING, NETWORK))
    assert fault.reason and "\n" not in fault.reason


def test_the_reason_is_the_errors_one_line():
    assert classify(ValueError("bad batch at step 7")) == Fault(USER, "ValueError: bad batch at step 7")
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1\nmore")
    assert classify(gloo) == Fault(RING, "RuntimeError: Connection closed by peer [127.0.0.1]:1")
    unreachable = PeersUnreachable(2, ["10.0.0.1"], "connect")
    assert classify(unreachable).reason == str(unreachable)  # a sentence already


@pytest.mark.parametrize("exc, peer_lost, kind", [
    (dist.DistNetworkError("Connection reset by peer"), False, NETWORK),  # all reached the store, not each other
    (dist.DistNetworkError("Connection reset by peer"), True, RING),  # a peer died while the ring formed
    (ValueError("bad argument"), False, USER),
    (torch.OutOfMemoryError("out of memory"), False, PROCESS),
])
def test_a_failed_init_of_a_round(exc, peer_lost, kind):
    assert classify_init(exc, peer_lost=peer_lost).kind == kind


def test_raised_from_user_code_with_a_traceback_too():
    def step():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    with pytest.raises(torch.OutOfMemoryError) as caught:
        step()
    assert classify(caught.value).kind == PROCESS
