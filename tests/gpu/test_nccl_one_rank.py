"""T3: a one-rank NCCL ring: eager and lazy init, DDP, the abort of a pending operation,
a commit after the abort, and NCCL's error-handling modes (gpu review F2-F5).

The abort tests run in this process with a one-rank group on a PrefixStore, as the
runtime makes them; the modes run in child processes (TORCH_NCCL_* are read at init,
and tear-down kills the process)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from elastic.state import State
from elastic.worker import ring_abort
from elastic.contract.faults import RING
from elastic.worker.failures import classify
from tests.fakes.jobs import REPO
from tests.fakes.ring import installed, real_ring
from tests.gpu.conftest import NEEDS_CUDA, NEEDS_TWO_GPUS

pytestmark = [NEEDS_CUDA, pytest.mark.timeout(300)]
CYCLES_PER_S = int(1e9)


def _init(round_number: int, eager: bool, timeout_s: float = 60.0):
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # the runtime's choice (worker_env.py)
    store = dist.PrefixStore(f"/round/{round_number}/", dist.HashStore())
    before = ring_abort.socket_snapshot()
    extra = {"device_id": torch.device("cuda", torch.cuda.current_device())} if eager else {}
    dist.init_process_group("nccl", store=dist.PrefixStore("pg/", store), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout_s), **extra)
    return ring_abort.prepare_ring(before=before)


@pytest.fixture(autouse=True)
def _no_group_left():
    yield
    if dist.is_initialized():
        ring_abort.nccl_abort.leave_aborted(deadline_s=30, on_overrun=lambda why: None)


@pytest.mark.parametrize("eager", [True, False])
def test_all_reduce_and_ddp_steps(eager):
    ring = _init(1, eager)
    assert ring.backend_abort and ring.error() is None
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    assert x.tolist() == [1.0] * 4
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2).cuda(), init_sync=False)
    for _ in range(3):
        model(torch.randn(4, 8, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    ring_abort.leave_ring(ring, failed=False, round_number=1)
    assert not dist.is_initialized()


def test_an_abort_ends_a_pending_operation_and_the_ring_can_form_again():
    ring = _init(2, eager=True)
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda._sleep(5 * CYCLES_PER_S)
    dist.all_reduce(x)  # queued behind the sleep: pending
    started = time.monotonic()
    caller = threading.Thread(target=ring.abort)  # the etcd watch thread's call
    caller.start()
    caller.join(5)
    assert not caller.is_alive() and ring.aborted
    assert ring.wait_aborted() and time.monotonic() - started < 5.0
    with pytest.raises(Exception) as raised:
        dist.all_reduce(x)
        torch.cuda.synchronize()
    assert classify(raised.value).kind == RING, raised.value
    with pytest.raises(ring_abort.RingBroken):
        ring_abort.check_ring(ring, device_sync=True)
    started = time.monotonic()
    ring_abort.leave_ring(ring, failed=True, round_number=2)
    assert time.monotonic() - started < 5.0 and not dist.is_initialized()
    ring = _init(3, eager=True)
    y = torch.full((4,), 3.0, device="cuda")
    dist.all_reduce(y)
    assert y.tolist() == [3.0] * 4
    ring_abort.leave_ring(ring, failed=False, round_number=3)


def test_a_commit_after_an_abort_raises_and_keeps_the_previous_commit():
    ring = real_ring(_init(4, eager=True), backend="nccl")  # a Ring on the test's process group
    try:
        with installed(ring):
            state = State(weights=torch.zeros(1024, device="cuda"))
            state.commit()
            before = state.commit_id
            torch.cuda._sleep(2 * CYCLES_PER_S)
            dist.all_reduce(state.weights)
            state.weights.add_(1.0)  # the optimizer step after the collective
            ring.abort()
            with pytest.raises(ring_abort.RingBroken):
                state.commit()
        assert state.commit_id == before
        state.restore()
        assert torch.all(state.weights == 0.0) and state.weights.is_cuda
    finally:
        ring_abort.leave_ring(ring.handle, failed=True, round_number=4)


_MODE_CHILD = textwrap.dedent("""
    import datetime, sys, time, torch, torch.distributed as dist
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=2), device_id=torch.device("cuda", 0))
    x = torch.ones(4, device="cuda")
    torch.cuda._sleep(int(8e9))
    dist.all_reduce(x)
    time.sleep(20)  # NCCL's watchdog acts meanwhile, or not
    print("alive", flush=True)
""")


@pytest.mark.parametrize("mode, killed", [("0", False), ("1", True), ("2", False), ("3", True)])
def test_nccls_error_handling_modes(mode, killed):
    """What each TORCH_NCCL_ASYNC_ERROR_HANDLING mode does to a process whose op times out
    (the review's reading of ProcessGroupNCCL: 1 and 3 SIGABRT, 0 and 2 keep it alive)."""
    env = dict(os.environ, TORCH_NCCL_ASYNC_ERROR_HANDLING=mode, TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC="250",
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _MODE_CHILD], env=env, capture_output=True, text=True, timeout=120)
    if killed:
        assert proc.returncode == -6, (proc.returncode, proc.stderr[-2000:])
    else:
        assert proc.returncode == 0 and "alive" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


_PEER = textwrap.dedent("""
    import datetime, os, signal, sys, threading, time, torch, torch.distributed as dist
    from elastic.worker import ring_abort
    from elastic.contract.faults import RING
    from elastic.worker.failures import classify
    rank, path = int(sys.argv[1]), sys.argv[2]
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    torch.cuda.set_device(rank)
    before = ring_abort.socket_snapshot()
    dist.init_process_group("nccl", store=dist.FileStore(path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600), device_id=torch.device("cuda", rank))
    ring = ring_abort.prepare_ring(before=before)
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x); torch.cuda.synchronize()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-job: rank 0's next all-reduce waits for it
    dist.all_reduce(x)  # pending for ever
    time.sleep(2)
    started = time.monotonic()
    ring.abort()  # what the round naming rank 1 lost does
    assert ring.wait_aborted() and time.monotonic() - started < 10
    try:
        dist.all_reduce(x); torch.cuda.synchronize()
        raise SystemExit("the collective after the abort did not raise")
    except Exception as exc:
        assert classify(exc).kind == RING, exc
    ring_abort.leave_ring(ring, failed=True, round_number=1)
    assert not dist.is_initialized()
    print("recovered", time.monotonic() - started, flush=True)
""")


@NEEDS_TWO_GPUS
def test_a_peer_killed_mid_all_reduce_is_aborted_within_seconds(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    path = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", _PEER, str(r), path], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    out, err = procs[0].communicate(timeout=180)
    procs[1].wait(30)
    assert procs[0].returncode == 0 and "recovered" in out, err[-3000:]
    assert procs[1].returncode == -9
