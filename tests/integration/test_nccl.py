"""NCCL on GPUs: runs only where CUDA with two devices exists (never on CPU-only CI)."""

from __future__ import annotations

import pytest
import torch

from tests.fakes.jobs import Job

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs CUDA with at least 2 GPUs"),
]

SCRIPT = '''
import torch, elastic
from torch.nn.parallel import DistributedDataParallel as DDP
elastic.init()
device = torch.device("cuda", torch.cuda.current_device())
assert device.index == elastic.local_rank(), (device, elastic.local_rank())
model = torch.nn.Linear(8, 8).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
state = elastic.TorchState(model=model, optimizer=opt, step=0)

@elastic.run
def train(state):
    ddp = DDP(state.model, device_ids=[device.index])
    while state.step < 20:
        ddp(torch.randn(4, 8, device=device)).sum().backward()
        state.optimizer.step(); state.optimizer.zero_grad()
        state.step += 1
        state.commit()

train(state)
print("final", elastic.rank(), float(sum(p.sum() for p in model.parameters())))
'''


def test_two_gpu_workers_train_with_nccl(tmp_path):
    script = tmp_path / "gpu_job.py"
    script.write_text(SCRIPT)
    job = Job(tmp_path, ["--np", "2", "--backend", "nccl", "--log-dir", str(tmp_path / "logs"), str(script)])
    assert job.wait(180) == 0, job.text()[-3000:]
    finals = [line.split()[-2:] for line in job.text().splitlines() if "final" in line]
    # Both ranks finished, and they hold the same parameters.
    assert sorted(rank for rank, _ in finals) == ["0", "1"], finals
    assert len({value for _, value in finals}) == 1, finals


def test_a_laggard_receives_the_newest_commit_through_device_staging():
    """The NCCL path of State.sync: chunks staged through the GPU, state on the GPU."""
    from tests.integration.test_state_sync import run_ring

    results = run_ring(2, "laggard", "--backend", "nccl")
    assert [r["outcome"] for r in results] == ["synced: holders [0] receivers [1]"] * 2, results
    for r in results:
        assert (r["weights"], r["counts"], r["step"], r["commit"]) == ([2.0], [2], 2, [1, 2]), r
