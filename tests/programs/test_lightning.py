"""A PyTorch Lightning program (tests/programs/lightning_loop/train.py: `ModelCheckpoint(save_last=True)`
and `trainer.fit(ckpt_path="last")`, as docs/porting/from-lightning-accelerate-hf.md shows) under
elastic-run with torchrun's semantics: a worker SIGKILLed after the first checkpoint, every
worker restarted, the fit resumes from last.ckpt, and every step's learning rate and the
float64 weights equal a plain run's (one process, both ranks' batches together)."""

from __future__ import annotations

import importlib.util
import uuid

import pytest
import torch
import torch.nn.functional as F

from tests.fakes.jobs import Job
from tests.programs.runs import PROGRAMS, check_restarted_equal_to_plain, kill_when

# Looked up, not imported: importing Lightning at collection would cost every run of the suite
# seconds. The workers import it.
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None,
                                 reason="needs pytorch-lightning (pip install -e '.[test]')")]

PROGRAM = PROGRAMS / "lightning_loop" / "train.py"
STEPS, BATCH, WORLD, SAVE = 12, 8, 2, 4


def plain_run() -> tuple[dict, dict[int, float]]:
    """The program's model and data (its model.py), stepped by hand in one process. Lightning gives each rank
    a DistributedSampler that shuffles the training data whatever the loader says (seed 0,
    reshuffled by epoch): at step k of epoch e the two ranks train the permutation's slice
    [k*W*B, (k+1)*W*B) between them, and DDP's average of the ranks' means is its mean."""
    spec = importlib.util.spec_from_file_location("lightning_program_model", PROGRAM.parent / "model.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    x, y = program.make_data().tensors
    net = program.make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    lrs, epoch = {}, 0
    while len(lrs) < STEPS:
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))  # DistributedSampler's
        for start in range(0, len(x), WORLD * BATCH):
            rows = order[start:start + WORLD * BATCH]
            lrs[len(lrs) + 1] = scheduler.get_last_lr()[0]
            optimizer.zero_grad()
            F.mse_loss(net(x[rows]), y[rows]).backward()
            optimizer.step()
            scheduler.step()
        epoch += 1
    assert len(lrs) == STEPS, "STEPS is a whole number of epochs"
    return net.state_dict(), lrs


@pytest.mark.slow  # two starts of Lightning workers: about 100 s on the loaded 2-core machine
def test_a_lightning_fit_resumes_from_last_ckpt_after_a_killed_worker_and_equals_a_plain_run(tmp_path, etcd_server):
    checkpoints, out = tmp_path / "ckpt", tmp_path / "final.pt"
    job = Job(tmp_path, ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", f"pl-{uuid.uuid4().hex[:8]}",
                         "--np", str(WORLD), "--nproc-per-node", str(WORLD), "--max-restarts", "1",
                         "--log-dir", str(tmp_path / "logs"), str(PROGRAM), "--checkpoints", str(checkpoints),
                         "--out", str(out), "--max-steps", str(STEPS), "--batch-size", str(BATCH),
                         "--save-every", str(SAVE), "--step-delay", "0.2"])
    kill_when(job, 1, (checkpoints / "last.ckpt").exists, 150, "the first checkpoint")
    check_restarted_equal_to_plain(job, WORLD, "Restoring states from the checkpoint path",
                                   tmp_path / "final.pt.steps.jsonl", out, plain_run)
