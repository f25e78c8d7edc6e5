"""HybridShardedState end to end: real etcd, real gloo workers training HSDP (FSDP2 over a
("replicate", "shard") mesh) in float64, with four FSDP units, AdamW, a StepLR and gradient
clipping (tests/fakes/hybrid_job.py); the final parameters must equal a plain
single-process run within 1e-12 at the same constant global batch, whatever the ring
went through. (A plain HSDP run equals the single process within 6e-17: test_hsdp_mesh.py.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import pytest
import torch

from tests.fakes.jobs import REPO, Job, read_jsonl, wait_until

pytestmark = pytest.mark.timeout(300)

HYBRID_JOB = REPO / "tests" / "fakes" / "hybrid_job.py"
ATOL = 1e-12


def start(tmp_path, launcher, script_args, *, name) -> Job:
    return Job(tmp_path, [*launcher, "--log-dir", str(tmp_path / "logs"), str(HYBRID_JOB), "--out",
                          str(tmp_path / "out"), *script_args], name=name)


def reference(tmp_path, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["PYTHONPATH"] = str(REPO)
    out = tmp_path / "reference"
    subprocess.run([sys.executable, str(HYBRID_JOB), "--reference", "--steps", str(steps), "--out", str(out)],
                   env=env, check=True, timeout=120, capture_output=True)
    return torch.load(out / "final.pt", weights_only=True)


def assert_equals_reference(tmp_path, steps: int) -> None:
    final = torch.load(tmp_path / "out" / "final.pt", weights_only=True)
    expected = reference(tmp_path, steps)
    assert set(final) == set(expected)
    for name, value in expected.items():
        assert final[name].dtype == torch.float64
        assert torch.allclose(final[name], value, rtol=0, atol=ATOL), (name, (final[name] - value).abs().max())


def mesh_lines(*jobs: Job) -> list[str]:
    """The meshes rank 0 logged, one per round: 'round 3: 1x2 groups [[0, 1]], spares [2]'."""
    found = []
    for job in jobs:
        found += re.findall(r"round \d+: (?:\d+x\d+ groups .*|flat 1-D mesh of \d+)", job.text())
    return found


def test_two_hosts_kill_spare_refill_then_host_loss(tmp_path, etcd_server):
    steps = 9
    job_id = f"hybrid-{uuid.uuid4().hex[:8]}"
    common = ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
              "--nproc-per-node", "2", "--min-np", "2", "--max-np", "4", "--collective-timeout", "20",
              "--max-restarts", "1"]
    script = ["--steps", str(steps), "--min-groups", "1", "--kill-at", "3:3", "--hold-at", "3:4",
              "--kill-at", "2:6:host"]
    a = start(tmp_path, [*common, "--host-id", "host-a"], script, name="a")
    wait_until(lambda: any(e["event"] == "member_joined" for e in a.events()), 60, "a to register")
    b = start(tmp_path, [*common, "--host-id", "host-b"], script, name="b")
    try:
        assert a.wait(280) == 0, a.text()[-4000:]
        b.proc.wait(30)
    finally:
        for job in (a, b):
            if job.proc.poll() is None:
                job.kill()
    print(a.text()[-6000:])
    assert_equals_reference(tmp_path, steps)
