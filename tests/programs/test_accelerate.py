"""An accelerate loop (tests/programs/accelerate_loop/train.py: accelerate's save_state/load_state
and skip_first_batches, as docs/porting/from-lightning-accelerate-hf.md shows) under
elastic-run with torchrun's semantics: a worker SIGKILLed after a checkpoint, every worker
restarted, the loop resumes mid-epoch, and every step's learning rate and the float64
weights equal a plain run's (one process, both ranks' batches together)."""

from __future__ import annotations

import importlib.util
import uuid

import pytest
import torch
import torch.nn.functional as F

from tests.fakes.jobs import Job
from tests.programs.runs import PROGRAMS, check_restarted_equal_to_plain, kill_when

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                 reason="needs accelerate (pip install -e '.[test]')")]

PROGRAM = PROGRAMS / "accelerate_loop" / "train.py"
EPOCHS, BATCH, WORLD, SAVE = 3, 8, 2, 8


def plain_run() -> tuple[dict, dict[int, float]]:
    """accelerate gives rank r the base loader's batch k*W + r at its step k: a step trains
    rows [k*W*B, (k+1)*W*B), and DDP's average of the ranks' means is their mean. Its
    prepared scheduler takes W steps per optimizer step (accelerate's rule for a batch W
    times larger than the single-process one)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(256, 20, generator=gen, dtype=torch.float64), torch.rand(256, 1, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    lrs, step = {}, 0
    for _ in range(EPOCHS):
        for start in range(0, len(x), WORLD * BATCH):
            step += 1
            lrs[step] = scheduler.get_last_lr()[0]
            optimizer.zero_grad()
            F.mse_loss(model(x[start:start + WORLD * BATCH]), y[start:start + WORLD * BATCH]).backward()
            optimizer.step()
            for _ in range(WORLD):  # accelerate steps a prepared scheduler once per process
                scheduler.step()
    return model.state_dict(), lrs


@pytest.mark.slow  # about 75 s on the loaded 2-core machine; the default run has the Trainer's
def test_an_accelerate_loop_resumes_from_its_state_after_a_killed_worker_and_equals_a_plain_run(
        tmp_path, etcd_server):
    checkpoints, out = tmp_path / "ckpt", tmp_path / "final.pt"
    job = Job(tmp_path, ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", f"acc-{uuid.uuid4().hex[:8]}",
                         "--np", str(WORLD), "--nproc-per-node", str(WORLD), "--max-restarts", "1",
                         "--log-dir", str(tmp_path / "logs"), str(PROGRAM), "--checkpoints", str(checkpoints),
                         "--out", str(out), "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
                         "--save-every", str(SAVE), "--step-delay", "0.1"])
    kill_when(job, 1, (checkpoints / str(SAVE)).exists, 150, f"checkpoint {SAVE}")
    check_restarted_equal_to_plain(job, WORLD, "resumed at step", tmp_path / "final.pt.steps.jsonl", out, plain_run)
