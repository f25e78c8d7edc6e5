"""Snapshot: reused buffers, in-place restore (copy_into), layouts for newcomers, clone_tree."""
import pickle
from collections import OrderedDict

import pytest
import torch

from elastic.checkpoint import Snapshot, clone_tree, copy_into


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def _adopted(layout):
    snap = Snapshot()
    snap.adopt_layout(layout)
    return snap


def _train_step(model, optimizer):
    optimizer.zero_grad()
    model(torch.randn(32, 8)).pow(2).mean().backward()
    optimizer.step()


def _tree(model, optimizer, epoch=0):
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": {"epoch": epoch, "indices": list(range(100)), "seed": 7},
        "values": {"epoch": epoch, "name": "run", "blob": b"\x00\x01", "none": None, "lr": 0.5, "flag": True},
        "rng": {"torch": torch.get_rng_state()},
    }


def _assert_trees_equal(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            _assert_trees_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_trees_equal(x, y)
    else:
        assert a == b


def test_capture_and_restore_round_trip_with_momentum():
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer)  # creates the momentum buffers
    snap = Snapshot()
    assert snap.empty
    snap.capture(_tree(model, optimizer, epoch=3))
    assert not snap.empty
    expected = clone_tree(_tree(model, optimizer, epoch=3))

    for _ in range(3):
        _train_step(model, optimizer)
    copy_into(snap.tree(), _tree(model, optimizer))

    restored = clone_tree(_tree(model, optimizer, epoch=3))
    _assert_trees_equal(restored["model"], expected["model"])
    _assert_trees_equal(restored["optimizer"], expected["optimizer"])
    got = snap.tree()
    _assert_trees_equal(got["rng"], expected["rng"])  # the RNG itself is set by the caller from tree()
    assert got["values"] == expected["values"] and got["sampler"] == expected["sampler"]
    assert isinstance(got["model"], OrderedDict)
    assert got["model"]._metadata == model.state_dict()._metadata  # BatchNorm version info survives
    assert _bytes(snap) >= sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_buffers_reused_while_layout_unchanged_and_reallocated_when_optimizer_gains_state():
    model, optimizer = _model_and_optimizer()
    snap = Snapshot()
    snap.capture(_tree(model, optimizer))  # no momentum yet
    first = [b.data_ptr() for b in snap.buffers()]
    snap.capture(_tree(model, optimizer, epoch=1))
    assert [b.data_ptr() for b in snap.buffers()] == first
    assert snap.tree()["values"]["epoch"] == 1  # plain values are re-captured every time

    _train_step(model, optimizer)  # momentum_buffer appears: the layout changes
    snap.capture(_tree(model, optimizer))
    grown = [b.data_ptr() for b in snap.buffers()]
    assert grown != first
    assert set(snap.tree()["optimizer"]["state"]) == {0, 1, 2, 3, 4, 5}
    snap.capture(_tree(model, optimizer))
    assert [b.data_ptr() for b in snap.buffers()] == grown


def test_one_flat_buffer_per_dtype():
    tree = {"a": torch.ones(3), "b": torch.zeros(2, 2), "n": torch.tensor(5), "c": torch.ones(1, dtype=torch.float64)}
    snap = Snapshot()
    snap.capture(tree)
    assert [b.dtype for b in snap.buffers()] == [torch.float32, torch.int64, torch.float64]
    assert all(b.dim() == 1 for b in snap.buffers())


def test_restore_into_keeps_tensor_identity():
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer)
    snap = Snapshot()
    snap.capture(_tree(model, optimizer))
    saved = [p.detach().clone() for p in model.parameters()]
    params_before = list(model.parameters())
    ptrs_before = [p.data_ptr() for p in params_before]
    momentum_before = [optimizer.state[p]["momentum_buffer"] for p in params_before]

    _train_step(model, optimizer)
    copy_into(snap.tree(), _tree(model, optimizer))

    assert all(a is b for a, b in zip(model.parameters(), params_before))
    assert [p.data_ptr() for p in model.parameters()] == ptrs_before
    assert all(optimizer.state[p]["momentum_buffer"] is m for p, m in zip(params_before, momentum_before))
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), saved))


def test_a_tensor_of_another_shape_is_a_fresh_copy_and_the_live_one_is_left_alone():
    snap = Snapshot()
    snap.capture({"model": {"a": torch.full((2,), 3.0), "b": torch.ones(3)}})
    target = {"model": {"a": torch.zeros(2), "b": torch.zeros(4)}, "extra": torch.zeros(1)}
    restored = copy_into(snap.tree(), target)
    assert restored["model"]["a"] is target["model"]["a"] and torch.equal(target["model"]["a"], torch.full((2,), 3.0))
    assert restored["model"]["b"] is not target["model"]["b"] and torch.equal(target["model"]["b"], torch.zeros(4))
    assert restored["model"]["b"].untyped_storage().data_ptr() not in {b.data_ptr() for b in snap.buffers()}
    assert torch.equal(target["extra"], torch.zeros(1))  # a path the snapshot does not have


def test_mutating_the_source_after_capture_does_not_change_the_snapshot():
    weights = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    values = {"history": [1, 2, 3], "cfg": {"lr": 0.1}}
    snap = Snapshot()
    snap.capture({"w": weights, "values": values})
    weights.add_(100)
    values["history"].append(4)
    values["cfg"]["lr"] = 9.0
    got = snap.tree()
    assert torch.equal(got["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert got["values"] == {"history": [1, 2, 3], "cfg": {"lr": 0.1}}


def test_capture_of_non_contiguous_and_scalar_tensors():
    base = torch.arange(12.0).reshape(3, 4)
    tree = {"t": base.t(), "s": torch.tensor(2.5), "e": torch.empty(0), "tup": (torch.ones(1), 4)}
    snap = Snapshot()
    snap.capture(tree)
    got = snap.tree()
    assert torch.equal(got["t"], base.t()) and got["s"].item() == 2.5 and got["e"].numel() == 0
    assert isinstance(got["tup"], tuple) and got["tup"][1] == 4


def test_from_layout_plus_buffers_reproduces_the_tree():
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer)
    source = Snapshot()
    source.capture(_tree(model, optimizer, epoch=2))

    layout = pickle.loads(pickle.dumps(source.layout()))  # what broadcast_object_list does
    newcomer = _adopted(layout)
    assert [b.shape for b in newcomer.buffers()] == [b.shape for b in source.buffers()]
    assert sum(n * dtype.itemsize for dtype, _, n in layout.buffers) == _bytes(source) == _bytes(newcomer)
    for dst, src in zip(newcomer.buffers(), source.buffers()):
        dst.copy_(src)  # what broadcast does
    _assert_trees_equal(newcomer.tree(), source.tree())

    other_model, other_optimizer = _model_and_optimizer(seed=1)
    other_optimizer.load_state_dict(clone_tree(newcomer.tree()["optimizer"]))
    copy_into(newcomer.tree()["model"], other_model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other_model.parameters(), model.parameters()))


def test_float64_is_exact():
    values = torch.tensor([1 / 3, 1e-300, 1e300, -0.0, float("inf"), 2**53 + 1], dtype=torch.float64)
    values = torch.cat([values, torch.randn(1000, dtype=torch.float64)])
    snap = Snapshot()
    snap.capture({"x": values, "y": torch.ones(3)})
    got = snap.tree()["x"]
    assert got.dtype == torch.float64
    assert torch.equal(got.view(torch.int64), values.view(torch.int64))  # bit for bit


def test_clone_tree_never_aliases():
    snap = Snapshot()
    snap.capture({"opt": {"state": {0: {"momentum_buffer": torch.ones(4)}}, "param_groups": [{"lr": 0.1}]}})
    cloned = clone_tree(snap.tree())
    buffer_ptrs = {b.untyped_storage().data_ptr() for b in snap.buffers()}
    assert cloned["opt"]["state"][0]["momentum_buffer"].untyped_storage().data_ptr() not in buffer_ptrs
    cloned["opt"]["state"][0]["momentum_buffer"].add_(1)
    assert torch.equal(snap.tree()["opt"]["state"][0]["momentum_buffer"], torch.ones(4))


def test_unsupported_leaf_is_a_one_line_error_naming_the_path():
    class Thing:
        pass

    with pytest.raises(ValueError, match="values/thing") as info:
        Snapshot().capture({"values": {"thing": Thing()}, "t": torch.ones(1)})
    assert "\n" not in str(info.value)


def test_empty_snapshot_refuses_to_be_read():
    with pytest.raises(ValueError, match="empty"):
        Snapshot().tree()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_go_to_pinned_host_memory():
    tree = {"w": torch.randn(1000, device="cuda"), "c": torch.ones(3)}
    snap = Snapshot()
    snap.capture(tree)
    gpu_buffer = [b for b in snap.buffers() if b.is_pinned()]
    assert len(gpu_buffer) == 1 and gpu_buffer[0].device.type == "cpu"
    assert torch.equal(snap.tree()["w"], tree["w"].cpu())
    target = {"w": torch.zeros(1000, device="cuda")}
    copy_into(snap.tree(), target)
    assert torch.equal(target["w"], tree["w"])


def test_adopt_layout_reuses_the_buffers_of_an_equal_layout_and_reallocates_for_another():
    model, optimizer = _model_and_optimizer()
    _train_step(model, optimizer)
    source = Snapshot()
    source.capture(_tree(model, optimizer, epoch=1))
    receiver = _adopted(source.layout())
    first = [b.data_ptr() for b in receiver.buffers()]

    _train_step(model, optimizer)
    source.capture(_tree(model, optimizer, epoch=2))
    receiver.adopt_layout(pickle.loads(pickle.dumps(source.layout())))
    assert [b.data_ptr() for b in receiver.buffers()] == first  # no allocation for the same layout
    for dst, src in zip(receiver.buffers(), source.buffers()):
        dst.copy_(src)
    _assert_trees_equal(receiver.tree(), source.tree())  # plain values (epoch 2) came with the layout

    bigger = Snapshot()
    bigger.capture({"w": torch.ones(5000)})
    receiver.adopt_layout(bigger.layout())
    assert _bytes(receiver) == _bytes(bigger) and list(receiver.tree()) == ["w"]


def _bytes(snapshot: Snapshot) -> int:
    """Bytes of one capture's buffers."""
    return sum(b.numel() * b.element_size() for b in snapshot.buffers())
