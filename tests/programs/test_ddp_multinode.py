"""pytorch/examples' DDP tutorial (multinode.py: a snapshot file, every worker restarted on a
failure) under elastic-run, torchrun-style: a worker SIGKILLed mid-run, every worker
restarted from the snapshot, the job completes, and the float64 weights equal a plain
run's (one process, the two ranks' batches together, the same samplers)."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from tests.fakes.jobs import Job
from tests.programs.runs import PROGRAMS, kill_when

pytestmark = pytest.mark.timeout(240)

PROGRAM = PROGRAMS / "ddp_multinode"
EPOCHS, SIZE, BATCH, WORLD = 40, 512, 16, 2


def plain_run() -> dict:
    """The tutorial's training without DDP: batch b of the step is the union of every
    rank's batch b (DistributedSampler's own split), its mean loss DDP's average."""
    import sys
    sys.path.insert(0, str(PROGRAM))
    try:
        from datautils import RandomPairs
    finally:
        sys.path.remove(str(PROGRAM))
    data = RandomPairs(SIZE)
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    samplers = [DistributedSampler(data, num_replicas=WORLD, rank=r) for r in range(WORLD)]
    for epoch in range(EPOCHS):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        orders = [list(s) for s in samplers]
        for start in range(0, len(orders[0]), BATCH):
            rows = [i for order in orders for i in order[start:start + BATCH]]
            optimizer.zero_grad()
            F.mse_loss(model(data.inputs[rows]), data.targets[rows]).backward()
            optimizer.step()
    return model.state_dict()


def test_the_tutorial_survives_a_killed_worker_from_its_snapshot_and_equals_a_plain_run(tmp_path, etcd_server):
    snapshot = tmp_path / "snapshot.pt"
    job = Job(tmp_path, ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", f"tutorial-{uuid.uuid4().hex[:8]}",
                         "--np", str(WORLD), "--nproc-per-node", str(WORLD), "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"),
                         str(PROGRAM / "multinode.py"), str(EPOCHS), "1", "--batch_size", str(BATCH),
                         "--dataset_size", str(SIZE), "--snapshot_path", str(snapshot)])
    kill_when(job, 1, snapshot.exists, 150, "the first snapshot")
    assert job.wait(180) == 0, job.text()[-3000:]

    started = [e for e in job.events() if e["event"] == "worker_started"]
    assert len(started) == 2 * WORLD, job.text()[-3000:]          # every worker restarted once
    assert "Resuming training from snapshot at Epoch" in job.text()
    final = torch.load(snapshot, weights_only=True)
    assert final["EPOCHS_RUN"] == EPOCHS
    for name, value in plain_run().items():
        assert torch.allclose(final["MODEL_STATE"][name], value, rtol=0, atol=1e-12), name
