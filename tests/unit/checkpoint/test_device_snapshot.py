"""Commits that do not drain the device (gpu review G13), on the CPU with fake streams and
events: the copy is ordered after the step's last kernel, the training stream waits at
once only for what the next forward may write, the next optimizer step waits for the
rest, and a capture becomes the rollback target only when its copy has completed on a
ring that did not fail. The stall figure itself needs a GPU (tests/gpu/check.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from elastic.checkpoint import device_snapshot
from elastic.checkpoint.device_snapshot import DISCARD, PROMOTE, WAIT, OverlappedCopy, guarded_pointers, promotion
from elastic.checkpoint.snapshot import Snapshot
from elastic.worker import device_commit
from elastic.worker.ring_abort import RingBroken, RingHandle, failed_reason
from elastic.contract.devices import capability
from tests.fakes.ring import FakeRing


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.name))


class FakeEvent:
    def __init__(self, name, log, done=True):
        self.name, self.log, self.done = name, log, done

    def record(self, stream):
        self.log.append(("record", self.name, stream.name))

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append(("synchronize", self.name))


class FakeOps:
    def __init__(self):
        self.log, self.active, self.events = [], None, 0
        self.side, self.current = FakeStream("side", self.log), FakeStream("training", self.log)

    def side_stream(self, device):
        return self.side

    def current_stream(self, device):
        return self.current

    @contextlib.contextmanager
    def on(self, stream):
        self.active = stream
        yield
        self.active = None

    def event(self):
        self.events += 1
        return FakeEvent(f"e{self.events}", self.log)


class FakeTensor:
    """A device tensor stand-in: its device, its storage pointer, copies logged with the stream."""

    def __init__(self, name, ptr, ops):
        self.name, self.ptr, self.ops, self.device = name, ptr, ops, "cuda:0"

    def data_ptr(self):
        return self.ptr

    def copy_(self, src, non_blocking=False):
        assert non_blocking
        self.ops.log.append(("copy", src.name, self.ops.active.name if self.ops.active else None))


def test_the_copy_follows_the_step_and_the_training_stream_waits_only_for_what_the_forward_writes():
    ops = FakeOps()
    overlap = OverlappedCopy(ops)
    weight, bn_mean, exp_avg = (FakeTensor(n, p, ops) for n, p in (("weight", 1), ("bn_mean", 2), ("exp_avg", 3)))
    overlap.guarded = frozenset({1, 3})  # the optimizer's parameter and state
    views = [FakeTensor(f"host_{t.name}", 100 + t.ptr, ops) for t in (weight, bn_mean, exp_avg)]
    events = overlap.copy(views, [weight, bn_mean, exp_avg])
    assert ops.log == [
        ("wait_stream", "side", "training"),  # after the step's last kernel, on the device
        ("copy", "bn_mean", "side"),  # what the next forward writes: first ...
        ("record", "e1", "side"),
        ("wait_event", "training", "e1"),  # ... and the only wait the training stream has now
        ("copy", "weight", "side"),
        ("copy", "exp_avg", "side"),
        ("record", "e2", "side"),
    ]
    assert [e.name for e in events] == ["e2"] and overlap.gate.holding
    ops.log.clear()
    overlap.gate.before_write()  # the next optimizer.step()
    assert ops.log == [("wait_event", "training", "e2")] and not overlap.gate.holding
    overlap.gate.before_write()
    assert ops.log == [("wait_event", "training", "e2")]  # once per capture


def test_the_optimizer_step_settles_a_completed_capture_then_waits_for_the_copy_on_the_device():
    ops = FakeOps()
    overlap = OverlappedCopy(ops)
    settled = []
    overlap.settle_if_done = lambda: settled.append(len(ops.log))
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    overlap.install(optimizer)
    overlap.install(optimizer)  # one hook per optimizer
    overlap.gate.hold("cuda:0", FakeEvent("copy", ops.log))
    param.grad = torch.ones(3)
    optimizer.step()
    assert settled == [0] and ops.log == [("wait_event", "training", "copy")]
    assert torch.allclose(param.detach(), torch.full((3,), 0.9))


@pytest.mark.parametrize("copied, failure, expected", [
    (False, None, WAIT),
    (False, "aborted", WAIT),  # still copying: nothing decided yet
    (True, None, PROMOTE),
    (True, "aborted", DISCARD),  # its weights may be half-reduced: the previous capture stays
    (True, "TIMEOUT", DISCARD),
])
def test_promotion(copied, failure, expected):
    assert promotion(copied, failure) == expected


@pytest.mark.parametrize("failure, front", [(None, "capture 2"), ("aborted", "capture 1")])
def test_a_capture_made_on_a_ring_that_failed_is_never_read(failure, front):
    ops = FakeOps()
    snap = Snapshot()
    snap.overlap = OverlappedCopy(ops)
    snap.overlap.ring_of_capture = lambda: (lambda: failure)
    snap.overlap.copy([], [])  # takes the ring of the capture
    snap._front, snap._back, snap._pending = "capture 1", "capture 2", [FakeEvent("e", ops.log)]
    snap._settle()
    assert snap._front == front and snap._pending is None


def test_a_capture_still_copying_is_left_in_flight_by_the_optimizers_look():
    ops = FakeOps()
    snap = Snapshot()
    snap.overlap = OverlappedCopy(ops)
    snap._front, snap._back, snap._pending = "capture 1", "capture 2", [FakeEvent("e", ops.log, done=False)]
    snap._settle_if_done()
    assert snap._front == "capture 1" and snap._pending is not None
    snap._pending[0].done = True
    snap._settle_if_done()
    assert snap._front == "capture 2" and snap._pending is None


def test_what_only_the_optimizer_writes_is_guarded():
    model = torch.nn.BatchNorm1d(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guarded = guarded_pointers(optimizer)
    state = model.state_dict()  # views of the same memory as the parameters
    assert state["weight"].data_ptr() in guarded and state["bias"].data_ptr() in guarded
    assert state["running_mean"].data_ptr() not in guarded  # the forward writes it
    assert guarded_pointers(None) == frozenset()


class _Backend:
    def abort(self):
        pass

    def get_error(self):
        return type("Kind", (), {"name": "SUCCESS"})()


def test_a_ring_left_by_plan_did_not_fail_a_ring_aborted_for_a_failure_did():
    planned, failed = RingHandle(frozenset(), other_backend=_Backend()), RingHandle(frozenset(), other_backend=_Backend())
    planned.abort(sockets=False)
    failed.abort()
    assert failed_reason(planned) is None and failed_reason(failed) == "aborted"
    assert failed_reason(None) is None


@pytest.mark.parametrize("backend, env, drains", [
    ("nccl", "0", True), ("cpu:gloo,cuda:nccl", "0", True), ("cpu:gloo,cuda:nccl", "1", False), ("gloo", "0", False),
])
def test_a_commit_drains_the_device_unless_overlapped(monkeypatch, backend, env, drains):
    monkeypatch.setenv(device_snapshot.ENV, env)
    assert device_commit.drains_at_commit(capability(backend)) == drains


def _ring(handle):
    return FakeRing(backend="cpu:gloo,cuda:nccl", handle=handle)


def test_a_planned_leave_checks_the_ring_first_when_commits_are_overlapped(monkeypatch):
    broken = RingHandle(frozenset(), other_backend=_Backend())
    broken.abort()
    device_commit.before_planned_leave(_ring(broken))  # off: the commit's own check did it
    monkeypatch.setenv(device_snapshot.ENV, "1")
    with pytest.raises(RingBroken):
        device_commit.before_planned_leave(_ring(broken))
    device_commit.before_planned_leave(_ring(RingHandle(frozenset(), other_backend=_Backend())))


def test_prepare_is_a_no_op_without_cuda_and_wires_the_capture_to_its_ring_with_it(monkeypatch):
    snap, model = Snapshot(), torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setenv(device_snapshot.ENV, "1")
    device_commit.prepare(snap, optimizer, lambda: pytest.fail("no ring is needed without CUDA"))
    assert snap.overlap is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ring = RingHandle(frozenset(), other_backend=_Backend())
    device_commit.prepare(snap, optimizer, lambda: _ring(ring))
    assert snap.overlap is not None and model.weight.data_ptr() in snap.overlap.guarded
    state = snap.overlap.ring_of_capture()
    assert state() is None
    ring.abort()
    assert state() == "aborted"
    monkeypatch.setenv(device_snapshot.ENV, "0")
    device_commit.prepare(snap, optimizer, lambda: _ring(ring))
    assert snap.overlap is None
