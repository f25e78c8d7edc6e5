"""Running tests/fakes/sharded_job.py under elastic-run and checking it against its plain reference."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

import torch

from tests.fakes.jobs import REPO, Job

SHARDED_JOB = REPO / "tests" / "fakes" / "sharded_job.py"


def start(tmp_path, launcher, script_args, *, name="job", env=None) -> Job:
    out, logs = tmp_path / "out", tmp_path / "logs"
    return Job(tmp_path, [*launcher, "--log-dir", str(logs), str(SHARDED_JOB), "--out", str(out), *script_args],
               name=name, env=env)


def reference(tmp_path, steps: int, extra: Sequence[str] = ()) -> dict:
    """The plain single-process run's final parameters (``extra``: e.g. ``--init``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["PYTHONPATH"] = str(REPO)
    out = tmp_path / "reference"
    subprocess.run([sys.executable, str(SHARDED_JOB), "--reference", "--steps", str(steps), "--out", str(out),
                    *extra], env=env, check=True, timeout=120, capture_output=True)
    return torch.load(out / "final.pt", weights_only=True)


def assert_equals_reference(tmp_path, steps: int, extra: Sequence[str] = ()) -> None:
    final = torch.load(tmp_path / "out" / "final.pt", weights_only=True)
    expected = reference(tmp_path, steps, extra)
    assert set(final) == set(expected)
    for name, value in expected.items():
        assert final[name].dtype == torch.float64
        assert torch.allclose(final[name], value, rtol=0, atol=1e-9), (name, (final[name] - value).abs().max())


def worlds(job: Job) -> list[int]:
    return [e["world_size"] for e in job.events() if e["event"] == "round_formed"]


def reshards(job: Job) -> list[str]:
    return [line for line in job.text().splitlines() if "re-sharded commit" in line]
