"""pytorch/examples' FSDP2 pattern ported to ShardedState (tests/programs/fsdp2/: its own
checkpoint.py and model.py beside the script, `from checkpoint import Checkpointer`) on CPUs
with gloo: a worker SIGKILLed mid-run, the survivor re-shards the last commit in-process
and finishes, and the float64 weights its Checkpointer exports equal a plain run's (one
process, no FSDP, the same batches, loss, clipping and Adam)."""

from __future__ import annotations

import importlib.util
import re
import sys
import uuid

import pytest
import torch

from tests.fakes.jobs import Job
from tests.programs.runs import PROGRAMS, kill_when

pytestmark = pytest.mark.timeout(240)

PROGRAM = PROGRAMS / "fsdp2"
STEPS, GLOBAL_BATCH = 14, 12


def plain_run() -> dict:
    """The example's loop in one process, without FSDP2 or elastic."""
    spec = importlib.util.spec_from_file_location("fsdp2_program_model", PROGRAM / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    vocab, seq_len = 32, 8
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = module.Transformer(module.ModelArgs(n_layers=2, n_heads=2, dim=8, vocab_size=vocab,
                                                    max_seq_len=seq_len, dropout_p=0.0))
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(STEPS):
            batch = torch.randint(0, vocab, (GLOBAL_BATCH, seq_len), generator=torch.Generator().manual_seed(step))
            model(batch).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optim.step()
            optim.zero_grad()
    finally:
        torch.set_default_dtype(previous)
    return model.state_dict()


def test_the_fsdp2_example_survives_a_killed_worker_and_equals_a_plain_run(tmp_path, etcd_server):
    out = tmp_path / "export"
    job = Job(tmp_path, ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", f"fsdp2-{uuid.uuid4().hex[:8]}",
                         "--np", "2", "--nproc-per-node", "2", "--min-np", "1", "--max-restarts", "0",
                         "--collective-timeout", "20", "--log-dir", str(tmp_path / "logs"),
                         str(PROGRAM / "example.py"), "--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH),
                         "--float64", "--step-delay", "0.3", "--out", str(out)])
    kill_when(job, 1, lambda: re.search(r"step 3 world 2", job.text()), 150, "step 3")
    assert job.wait(150) == 0, job.text()[-3000:]

    text = job.text()
    assert [e["world_size"] for e in job.events() if e["event"] == "round_formed"] == [2, 1], text[-3000:]
    assert re.search(r"re-sharded commit \d+ \(world 2 -> 1\)", text), text[-3000:]
    assert f"step {STEPS} world 1" in text
    exported = torch.load(out / str(STEPS) / "model_state_dict.pt", weights_only=True)
    expected = plain_run()
    assert set(exported) == set(expected)
    for name, value in expected.items():
        assert exported[name].dtype == torch.float64
        assert torch.allclose(exported[name], value, rtol=0, atol=1e-9), (name, (exported[name] - value).abs().max())
