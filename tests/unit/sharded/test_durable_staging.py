"""gpu review G11: a durable sharded commit clones no device tensor (+1x the shards on the
GPU); it relies on dcp.async_save staging the state to host memory before it returns."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from elastic.sharded.durable import _cloned


def test_host_tensors_are_cloned_device_tensors_are_left_to_dcps_stager():
    host = torch.arange(4.0)
    device = torch.empty(4, device="meta")  # a stand-in for a CUDA tensor: no clone may be made of it
    tree = _cloned({"model": {"w": host}, "optim": [device, 3]})
    assert tree["model"]["w"].data_ptr() != host.data_ptr() and torch.equal(tree["model"]["w"], host)
    # The same storage: no copy of it was made.
    assert tree["optim"][0].untyped_storage()._cdata == device.untyped_storage()._cdata
    assert tree["optim"][1] == 3


def test_async_save_has_copied_the_state_when_it_returns(tmp_path):
    # What the clone-free path depends on: the live tensors may change right after.
    live = {"w": torch.arange(1000.0)}
    future = dcp.async_save(live, checkpoint_id=str(tmp_path / "ckpt"))
    live["w"].mul_(-1)  # the step after the commit
    future.result(timeout=60)
    loaded = {"w": torch.zeros(1000)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))
    assert torch.equal(loaded["w"], torch.arange(1000.0))
