"""gpu review G11: a durable sharded commit clones no device tensor (+1x the shards on the
GPU); it relies on dcp.async_save staging the state to host memory before it returns.
(a): a state on CUDA is staged into pinned memory that the ring's next writes reuse."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic.checkpoint import CheckpointPolicy
from elastic.checkpoint import manifest as mf
from elastic.sharded import durable
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


# -- gpu review G11(a): a state on CUDA is staged into pinned memory kept across a ring's writes ------

@pytest.fixture
def world_of_one(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(durable, "_pinned_staging_refused", None)  # restored after the test
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Saves:
    """dcp.async_save, recording the stager each call passes."""

    def __init__(self, monkeypatch):
        self.stagers = []
        real = dcp.async_save

        def spy(state, **kwargs):
            self.stagers.append(kwargs.get("async_stager"))
            return real(state, **kwargs)

        monkeypatch.setattr(dcp, "async_save", spy)


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def write(writer, model, optimizer, step, value):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    writer.submit(model, optimizer, {"values": {}, "commits": step}, step=step, round_number=1, world=1)
    writer.flush()
    assert writer.last_error is None, writer.last_error


def weights_of(path):
    model, optimizer = model_and_optimizer()
    durable.load_into(str(path), model, optimizer, None)
    return {float(v) for p in model.parameters() for v in p.detach().reshape(-1)}


def test_a_state_on_cuda_is_staged_by_one_pinned_stager_kept_for_the_rings_writes(tmp_path, world_of_one,
                                                                                   monkeypatch):
    from torch.distributed.checkpoint.staging import DefaultStager

    # This machine has no CUDA: host tensors stand in for device ones, which are not cloned.
    monkeypatch.setattr(durable, "_on_cuda", lambda tree: True)
    monkeypatch.setattr(durable, "_cloned", lambda tree: tree)
    saves = Saves(monkeypatch)
    writer = durable.ShardedCheckpoints(CheckpointPolicy(str(tmp_path), keep=5))
    model, optimizer = model_and_optimizer()
    write(writer, model, optimizer, 1, 1.0)
    first = saves.stagers[0]
    staged = {id(s): c.data_ptr() for s, c in first._state_dict_stager._cached_storage_mapping.items()}
    write(writer, model, optimizer, 2, 2.0)  # into the same staging buffers: the first write is done
    assert isinstance(first, DefaultStager) and saves.stagers == [first, first]
    assert first._config.use_pinned_memory and not first._config.use_async_staging
    again = {id(s): c.data_ptr() for s, c in first._state_dict_stager._cached_storage_mapping.items()}
    assert len(staged) == 2 and again == staged  # the weight's and the bias's copies, reused
    assert weights_of(tmp_path / mf.step_dirname(1)) == {1.0} and weights_of(tmp_path / mf.step_dirname(2)) == {2.0}
    writer.abandon()  # a ring broke: the next ring's writes stage anew
    write(writer, model, optimizer, 3, 3.0)
    assert saves.stagers[2] is not None and saves.stagers[2] is not first
    assert weights_of(tmp_path / mf.step_dirname(3)) == {3.0}


def test_a_host_state_keeps_dcps_default_staging(tmp_path, world_of_one, monkeypatch):
    saves = Saves(monkeypatch)
    writer = durable.ShardedCheckpoints(CheckpointPolicy(str(tmp_path)))
    model, optimizer = model_and_optimizer()
    write(writer, model, optimizer, 1, 1.0)
    assert saves.stagers == [None]


def test_a_failed_pinned_staging_clears_cudas_error_and_stages_as_before_from_then_on(tmp_path, world_of_one,
                                                                                     monkeypatch, caplog):
    from torch.distributed.checkpoint.staging import AsyncStager

    class Refused(AsyncStager):
        def stage(self, state_dict):
            raise RuntimeError("Registering memory failed with cudaError: 712.")

        def close(self):
            pass

    cleared = []
    monkeypatch.setattr(durable, "_on_cuda", lambda tree: True)
    monkeypatch.setattr(durable, "_pinned_stager", Refused)
    monkeypatch.setattr(durable.host_pinning, "clear_last_error_with_library", lambda: cleared.append(1) or 712)
    saves = Saves(monkeypatch)
    writer = durable.ShardedCheckpoints(CheckpointPolicy(str(tmp_path), keep=5))
    model, optimizer = model_and_optimizer()
    write(writer, model, optimizer, 1, 1.0)
    write(writer, model, optimizer, 2, 2.0)
    assert cleared == [1] and "pageable memory from now on" in caplog.text and "712" in caplog.text
    assert [type(s).__name__ if s is not None else None for s in saves.stagers] == ["Refused", None, None]
    assert weights_of(tmp_path / mf.step_dirname(1)) == {1.0} and weights_of(tmp_path / mf.step_dirname(2)) == {2.0}
