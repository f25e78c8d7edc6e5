"""T5: the real elastic-run on one GPU with NCCL, its ring broken every few steps: about
a hundred re-formations (abort, reset, re-init, DDP rebuilt, restore), and the result
equals the same run without breaks (gpu review F2-F5, F10, F11)."""

from __future__ import annotations

import pytest
import torch

from tests.fakes.jobs import Job, read_jsonl
from tests.gpu.conftest import NEEDS_CUDA, etcd_binary_or_skip

pytestmark = [NEEDS_CUDA, pytest.mark.timeout(600)]
LAUNCH = ["--np", "1", "--min-np", "1", "--max-np", "1", "--backend", "nccl", "--max-resets", "500"]


def _run(tmp_path, name, extra):
    out, logs = tmp_path / name / "out", tmp_path / name / "logs"
    (tmp_path / name).mkdir()
    job = Job(tmp_path / name, Job.train_args(out, logs, LAUNCH, ["--device", "cuda", "--steps", "300", *extra]),
              env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert job.wait(540) == 0, job.text()[-3000:]
    finals = [torch.load(p, weights_only=True) for p in sorted(out.glob("final-*.pt"))]
    assert len(finals) == 1
    return job, finals[0]


def test_a_ring_broken_every_three_steps_trains_like_an_unbroken_one(tmp_path):
    etcd_binary_or_skip()
    _, clean = _run(tmp_path, "clean", [])
    job, broken = _run(tmp_path, "broken", ["--break-ring-every", "3"])
    for name, value in clean.items():
        assert torch.equal(value, broken[name]), name
    reforms = [e for e in job.events() if e["event"] == "reform_done"]
    assert len(reforms) >= 90 and all(e["failed"] for e in reforms)
    steps = [s["step"] for s in read_jsonl(job.out / "steps.jsonl")]
    assert max(steps) == 300
