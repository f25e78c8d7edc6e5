"""The NCCL state sync's staging: two buffers per peer used in turn, one
batch of every peer's next chunk at a time, bytes on the wire (complex dtypes too).
On the CPU the same code runs over gloo with the device set to the CPU: two holders
send stripes of three buffers to one receiver in chunks smaller than a stripe."""

from __future__ import annotations

import subprocess
import sys

import pytest

_RANK = """
import datetime, sys, torch, torch.distributed as dist
from elastic.worker import state_transfer as st
from elastic.worker.sync_plan import CommitId, Holding, plan_sync
rank, path = int(sys.argv[1]), sys.argv[2]
st.wire_device = lambda backend: torch.device("cpu")
torch.cuda.current_stream = lambda device=None: type("S", (), {"synchronize": lambda self: None})()
batches = []
real_batch = dist.batch_isend_irecv
dist.batch_isend_irecv = lambda ops: batches.append(len(ops)) or real_batch(ops)
dist.init_process_group("gloo", store=dist.FileStore(path, 3), rank=rank, world_size=3,
                        timeout=datetime.timedelta(seconds=30))
def state():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(1000, generator=g), torch.randint(0, 9, (333,), generator=g).to(torch.int16),
            torch.randn(50, generator=g, dtype=torch.complex64)]
holdings = [Holding(0, CommitId(1, 5)), Holding(1, CommitId(1, 5)), Holding(2, None)]
sizes = [(b.numel(), b.element_size()) for b in state()]
plan = plan_sync(holdings, sizes, 256)  # chunks of 256 bytes: several rounds per peer
buffers = state() if rank < 2 else [torch.zeros_like(b) for b in state()]
st.CHUNK_BYTES = 256
st._transfer_staged(plan.sends(rank) if rank < 2 else plan.receives(rank), rank < 2, buffers)
if rank == 2:
    assert all(torch.equal(a, b) for a, b in zip(buffers, state())), "received state differs"
    assert len(batches) > 2 and max(batches) == 2, batches  # one op per holder per round
dist.destroy_process_group()
print("ok", rank)
"""


@pytest.mark.timeout(300)
def test_staged_chunks_alternate_buffers_and_arrive_whole(tmp_path):
    path = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), path], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(3)]
    outputs = [p.communicate(timeout=280)[0] for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and f"ok {rank}" in out, out[-2000:]
