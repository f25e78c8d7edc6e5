"""A loop with a scheduler, a GradScaler, EMA weights and gradient accumulation through a
SIGKILL and a join: every step's learning rate, loss scale and EMA count, and the final
float64 parameters and EMA weights, equal a plain run's (real etcd, workers, all-reduces)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

from tests.fakes.jobs import REPO, Job, read_jsonl, wait_until

pytestmark = pytest.mark.timeout(300)

STATEFUL_JOB = REPO / "tests" / "fakes" / "stateful_job.py"
STEPS = 20


def agent(tmp_path, endpoint, job_id, nproc, script_args, *, name):
    launcher = ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--nproc-per-node", str(nproc),
                "--min-np", "2", "--max-np", "3", "--collective-timeout", "10"]
    return Job(tmp_path, [*launcher, "--log-dir", str(tmp_path / "logs"), str(STATEFUL_JOB),
                          "--out", str(tmp_path / "out"), *script_args], name=name)


def plain_run(out) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["PYTHONPATH"] = str(REPO)
    subprocess.run([sys.executable, str(STATEFUL_JOB), "--steps", str(STEPS), "--out", str(out)],
                   env=env, check=True, timeout=120, capture_output=True)
    return read_jsonl(out / "steps.jsonl")


def finals(out) -> list[dict]:
    return [torch.load(p, weights_only=True) for p in sorted(out.glob("final-*.pt"))]


def test_scheduler_scaler_ema_and_accumulation_follow_the_plain_run_through_a_kill_and_a_join(
        tmp_path, etcd_server):
    job_id = f"objects-{uuid.uuid4().hex[:8]}"
    # A commit every second step: the kill in step 8 rolls the survivors' step 7 (scheduler,
    # scaler, EMA included) back, and they train it again. Once shrunk, the ring commits
    # without training until the joiner arrives.
    args = ["--steps", str(STEPS), "--step-delay", "0.01", "--commit-every", "2", "--kill-rank", "1",
            "--kill-step", "8", "--hold-below-world", "3"]
    first = agent(tmp_path, etcd_server.endpoint, job_id, 3, args, name="first")
    wait_until(lambda: any(e["event"] == "reform_done" for e in first.events()), 120, "the shrink")
    second = agent(tmp_path, etcd_server.endpoint, job_id, 1, args, name="second")
    assert first.wait(240) == 0, first.text()[-3000:]
    assert second.wait(60) == 0, second.text()[-3000:]
    assert [e["world_size"] for e in first.events() if e["event"] == "round_formed"] == [3, 2, 3]

    plain = {s["step"]: s for s in plain_run(tmp_path / "plain")}
    steps = first.steps()
    # The rolled-back step ran twice, and the joiner trained: both are compared.
    assert sorted({s["step"] for s in steps}) == list(range(1, STEPS + 1))
    assert [s["step"] for s in steps if s["rank"] == 0].count(7) == 2
    pids = first.pids()
    joiner_pids = {e["pid"] for e in pids if e["round"] == max(p["round"] for p in pids)} \
        - {e["pid"] for e in pids if e["round"] == min(p["round"] for p in pids)}
    assert joiner_pids and any(s["pid"] in joiner_pids for s in steps)
    for record in steps:
        expected = plain[record["step"]]
        for key in ("lr", "next_lr", "scale", "n_averaged"):
            assert record[key] == expected[key], (key, record, expected)

    results = finals(first.out)
    assert len(results) == 3
    single = finals(tmp_path / "plain")[0]
    for result in results:
        for part in ("model", "ema"):
            for name, value in single[part].items():
                assert value.dtype == (torch.int64 if name == "n_averaged" else torch.float64)
                assert torch.allclose(result[part][name], value, rtol=0, atol=1e-9), (part, name)
