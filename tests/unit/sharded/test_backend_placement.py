"""Where the sharded state puts its model under each backend string, and what its commit's
meta carries between ranks (gpu review G6)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn as nn

from elastic.contract.devices import CPU_AND_CUDA
from elastic.contract.errors import ElasticError
from elastic.sharded import mesh, modules
from elastic.worker.sync_plan import CommitId


@pytest.mark.parametrize("backend, device", [
    (CPU_AND_CUDA, "cuda"),  # the default on GPU hosts: FSDP2 on the GPU, not the CPU
    ("cuda:nccl,cpu:gloo", "cuda"),
    ("gloo", "cpu"),
    ("cpu:gloo", "cpu"),
])
def test_the_model_lives_where_cuda_tensors_travel_over_nccl(backend, device):
    assert mesh.device_type(backend) == device


@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl"])
def test_a_backend_without_a_host_part_is_refused_in_one_line(backend):
    # The commit's slots are host memory sent between ranks: an NCCL-only group cannot carry them.
    with pytest.raises(ElasticError, match="--backend auto") as caught:
        mesh.device_type(backend)
    assert "\n" not in str(caught.value)


def test_the_commit_meta_holds_host_copies_only():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    meta = modules.describe(CommitId(1, 1), 1, model, optimizer, {}, {"step": 1}, None)
    tensors = list(meta.buffers.values()) + [v for s in meta.plain_state.values() for v in s.values()
                                             if isinstance(v, torch.Tensor)]
    assert len(meta.buffers) == 3 and meta.plain_state  # running mean/var, batches; Adam's moments and step
    assert all(t.device.type == "cpu" for t in tensors)
    live = {b.data_ptr() for b in model.buffers()} | {
        v.data_ptr() for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)}
    assert not live & {t.data_ptr() for t in tensors}  # copies: the next step must not change the commit
    back = pickle.loads(pickle.dumps(meta))
    assert torch.equal(back.buffers["1.running_mean"], model[1].running_mean)
