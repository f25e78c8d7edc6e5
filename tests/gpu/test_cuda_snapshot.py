"""T1: CUDA snapshots: stream ordering, pinned exact-size buffers, the double buffer,
devices and the CUDA generator through commit and restore (docs/gpus.md)."""

from __future__ import annotations

import pytest
import torch

from elastic.checkpoint import Snapshot
from elastic.state import State, TorchState
from elastic.worker.ring_abort import RingHandle
from tests.fakes.ring import installed, real_ring
from tests.gpu.conftest import NEEDS_CUDA

pytestmark = [NEEDS_CUDA, pytest.mark.timeout(300)]
CYCLES_PER_S = int(1e9)  # torch.cuda._sleep spins cycles; about a second on a 1-2 GHz GPU


@pytest.fixture
def runtime():
    """A ring of one on NCCL: its commit syncs the current stream before the capture (the ring check)."""
    with installed(real_ring(RingHandle(frozenset()), backend="nccl")) as ring:
        yield ring


def test_a_capture_sees_the_work_queued_before_it():
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(2 * CYCLES_PER_S)
    x.add_(1.0)
    snapshot = Snapshot()
    snapshot.capture({"x": x})
    assert torch.all(snapshot.tree()["x"] == 1.0)


def test_the_next_step_cannot_overwrite_a_copy_in_flight():
    x = torch.zeros(64 << 20, device="cuda")  # 256 MB: the copy takes milliseconds
    snapshot = Snapshot()
    snapshot.capture({"x": x})
    x.add_(1.0)  # queued on the training stream, which waits for the copy on the device
    assert torch.all(snapshot.tree()["x"] == 0.0)
    snapshot.capture({"x": x})
    assert torch.all(snapshot.tree()["x"] == 1.0)


def test_a_capture_returns_before_its_copy_completes():
    x = torch.ones(64 << 20, device="cuda")
    snapshot = Snapshot()
    snapshot.capture({"x": x})  # allocates (and settles nothing)
    torch.cuda.synchronize()
    torch.cuda._sleep(2 * CYCLES_PER_S)  # the copy queues behind a second of device work
    snapshot.capture({"x": x})
    assert not all(event.query() for event in snapshot._pending)  # the host did not wait
    assert torch.all(snapshot.tree()["x"] == 1.0)  # reading waits for it
    assert snapshot._pending is None


def test_buffers_are_pinned_at_exactly_the_layouts_size():
    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats()["allocated_bytes.current"] if stats else None
    x = torch.ones(3_000_001, device="cuda")  # not a power of two
    snapshot = Snapshot()
    snapshot.capture({"x": x})
    for buffer in snapshot.buffers():
        assert buffer.is_pinned()
    assert sum(b.numel() * b.element_size() for b in snapshot.buffers()) == 3_000_001 * 4 + 0
    if stats:  # registered memory: the caching host allocator holds nothing for it
        assert stats()["allocated_bytes.current"] == before
    snapshot.capture({"x": torch.ones(5, device="cuda")})  # a layout change unpins the old buffers
    assert len(snapshot._registered) == 2  # the new layout's two banks only


@pytest.mark.parametrize("options", [{"foreach": True}, {"fused": True}, {"capturable": True, "foreach": True}])
def test_adam_on_cuda_rolls_back_to_the_commit(runtime, options):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, **options)
    state = TorchState(model=model, optimizer=optimizer, ema=torch.zeros(32, device="cuda"))

    def step():
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        state.ema.mul_(0.5).add_(model.bias.detach())

    step()
    state.commit()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    saved_ema = state.ema.clone()
    step()
    state.restore()
    for name, value in model.state_dict().items():
        assert value.is_cuda and torch.equal(value, saved[name]), name
    for moment, before in zip((s["exp_avg"] for s in optimizer.state.values()), saved_moments):
        assert moment.is_cuda and torch.equal(moment, before)
    assert state.ema.is_cuda and torch.equal(state.ema, saved_ema)


def test_a_cuda_value_of_another_shape_comes_back_on_cuda(runtime):
    state = State(history=torch.arange(3.0, device="cuda"))
    state.commit()
    state.history = [1, 2]  # the live value is no tensor any more
    state.restore()
    assert state.history.is_cuda and state.history.tolist() == [0.0, 1.0, 2.0]


def test_the_cuda_generator_rolls_back_with_the_commit(runtime):
    state = State(step=0)
    torch.rand(1, device="cuda")
    state.commit()
    first = torch.rand(4, device="cuda")
    state.restore()
    assert torch.equal(torch.rand(4, device="cuda"), first)


def test_an_overlapped_commit_holds_the_committed_values_while_the_next_step_writes(monkeypatch):
    # G13, opt-in: no drain, the copy overlaps the next step; the next optimizer.step()
    # waits for it on the device (its pre-hook), so the capture holds the committed
    # weights and becomes the rollback target once copied on an intact ring.
    from elastic.checkpoint.device_snapshot import ENV
    from elastic.worker import device_commit

    monkeypatch.setenv(ENV, "1")
    model = torch.nn.Linear(4096, 4096, device="cuda")  # 64 MB of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    ring = types.SimpleNamespace(_ring=None)
    snapshot = Snapshot()
    device_commit.prepare(snapshot, optimizer, lambda: ring)
    assert snapshot.overlap is not None
    # SGD's step can be replayed as a CUDA graph, so a commit overlaps only once a step
    # went through the hook since the commit before (gpu review 3, N8): a first commit
    # (it drains) and one hooked step first.
    snapshot.capture({"model": model.state_dict()})
    model.weight.grad = torch.zeros_like(model.weight)
    optimizer.step()
    device_commit.prepare(snapshot, optimizer, lambda: ring)
    with torch.no_grad():
        model.weight.fill_(1.0)
    torch.cuda._sleep(2 * CYCLES_PER_S)  # the step's kernels: the copy must come after them
    with torch.no_grad():
        model.weight.add_(1.0)  # the committed value: 2.0
    snapshot.capture({"model": model.state_dict()})
    model.weight.grad = torch.ones_like(model.weight)
    optimizer.step()  # the next step's write: waits for the copy on the device, not the host
    assert snapshot.overlap.last_mode == "overlap"
    committed = snapshot.tree()["model"]["weight"]
    assert torch.all(committed == 2.0)
    assert torch.all(model.weight.detach() == 1.0)
