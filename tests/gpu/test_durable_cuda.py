"""T2: durable checkpoints written from CUDA state hold host tensors only and load back
into a fresh CUDA model on its device (gpu review: durable, F7)."""

from __future__ import annotations

import os

import pytest
import torch

from elastic.checkpoint import CheckpointPolicy, DurableWriter, load_latest
from elastic.state import TorchState
from tests.gpu.conftest import NEEDS_CUDA

pytestmark = [NEEDS_CUDA, pytest.mark.timeout(300)]


def test_a_checkpoint_of_cuda_state_resumes_on_the_device(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32, device="cuda")).sum().backward()
    optimizer.step()
    source = TorchState(model=model, optimizer=optimizer, scale=torch.tensor([2.0], device="cuda"))
    writer = DurableWriter(CheckpointPolicy(str(tmp_path), every_commits=1))
    assert writer.submit(source.state_tree(), step=1, round=1, world_size=1)
    assert writer.flush(60) and writer.last_error is None
    tree, manifest = load_latest(str(tmp_path))
    assert manifest["step"] == 1
    files = [os.path.join(root, f) for root, _, names in os.walk(tmp_path) for f in names if f.endswith(".pt")]
    raw = torch.load(files[0], weights_only=True)  # no map_location: a CUDA storage would load on CUDA
    storages = []
    _walk(raw, storages)
    assert storages and all(t.device.type == "cpu" for t in storages)
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    fresh_opt = torch.optim.Adam(fresh.parameters())
    target = TorchState(model=fresh, optimizer=fresh_opt, scale=torch.tensor([0.0], device="cuda"))
    target._load(tree)
    for name, value in fresh.state_dict().items():
        assert value.is_cuda and torch.equal(value, model.state_dict()[name]), name
    assert target.scale.is_cuda and target.scale.item() == 2.0
    for state in fresh_opt.state.values():
        assert state["exp_avg"].is_cuda


def _walk(value, out):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, dict):
        for child in value.values():
            _walk(child, out)
    elif isinstance(value, (list, tuple)):
        for child in value:
            _walk(child, out)
