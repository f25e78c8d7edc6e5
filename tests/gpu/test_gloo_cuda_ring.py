"""T6: several workers on one GPU through gloo (NCCL refuses two ranks on one device):
pinned snapshots, syncs from pinned buffers, host-to-device restores, three CUDA
contexts, and a worker SIGKILLed and replaced on the same GPU (gpu review F6, F7)."""

from __future__ import annotations

import pytest
import torch

from tests.fakes.jobs import Job
from tests.gpu.conftest import NEEDS_CUDA, etcd_binary_or_skip

pytestmark = [NEEDS_CUDA, pytest.mark.timeout(600)]


def test_three_workers_on_one_gpu_survive_a_kill(tmp_path):
    etcd_binary_or_skip()
    out, logs = tmp_path / "out", tmp_path / "logs"
    launch = ["--np", "3", "--min-np", "2", "--backend", "gloo", "--max-restarts", "2"]
    job = Job(tmp_path, Job.train_args(out, logs, launch, ["--device", "cuda", "--steps", "60", "--step-delay", "0.05",
                                                           "--kill-rank", "1", "--kill-at", "10:after-allreduce"]))
    assert job.wait(540) == 0, job.text()[-3000:]
    finals = [torch.load(p, weights_only=True) for p in sorted(out.glob("final-*.pt"))]
    assert len(finals) >= 2
    for other in finals[1:]:
        for name, value in finals[0].items():
            assert torch.equal(value, other[name]), name
    assert any(e["event"] == "reform_done" and e["failed"] for e in job.events())
