"""GPU hangs are seen: device work pending since a commit's event, as
the worker's watch thread writes it and as the agent's watchdog judges it."""

from __future__ import annotations

import types

import pytest

from elastic.agent.watchdog import HangPolicy, device_floor, judge
from elastic.contract.progress import Marks, ProgressBoard
from elastic.worker.device_watch import DeviceWatch, commit_mark


class _Event:
    def __init__(self):
        self.done = False
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True
        self.stream = stream

    def query(self):
        return self.done


def _watch(board, clock):
    events = []

    def make():
        events.append(_Event())
        return events[-1]

    return DeviceWatch(board, make, clock=lambda: clock[0], start=False), events


def test_the_oldest_incomplete_commit_says_since_when_work_is_pending(tmp_path):
    path = str(tmp_path / "w.progress")
    ProgressBoard.create(path)
    board, agent_view = ProgressBoard(path, writable=True), ProgressBoard(path, writable=False)
    clock = [10.0]
    watch, events = _watch(board, clock)
    assert watch.poll() == 0.0
    watch.on_commit()
    clock[0] = 11.0
    watch.on_commit()
    assert events[0].recorded and watch.poll() == 10.0
    assert agent_view.read().device_since == 10.0
    events[0].done = True
    assert watch.poll() == 11.0
    events[1].done = True
    assert watch.poll() == 0.0 and agent_view.read().device_since == 0.0
    board.beat(12.0, 0.0, "train.py:3 in step")  # the where text still fits after the new slot
    assert agent_view.read().where == "train.py:3 in step"


def test_probes_see_a_hang_before_any_commit(tmp_path):
    path = str(tmp_path / "w.progress")
    ProgressBoard.create(path)
    board = ProgressBoard(path, writable=True)
    clock, events = [5.0], []

    def make():
        events.append(_Event())
        return events[-1]

    watch = DeviceWatch(board, make, clock=lambda: clock[0], start=False, probe_stream="default")
    assert watch.poll() == 5.0 and events[0].stream == "default"  # a probe is in flight
    events[0].done = True
    clock[0] = 6.0
    assert watch.poll() == 6.0 and len(events) == 2  # completed: the next probe
    clock[0] = 60.0
    assert watch.poll() == 6.0 and len(events) == 2  # a kernel that never ends holds the probe


def test_a_cpu_worker_starts_no_watch(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert commit_mark(None, types.SimpleNamespace()) is None


def _marks(now, **fields):
    base = dict(progress=5, progress_at=now - 1, slowest=2.0, beats=10, alive_at=now - 0.1)
    base.update(fields)
    return Marks(**base)


def test_the_watchdog_judges_device_work_pending_past_the_bound():
    policy, now = HangPolicy(), 1000.0
    assert not judge(_marks(now, device_since=now - 5.0), policy, now).hung  # bound 3 x 2 s = 6 s
    verdict = judge(_marks(now, device_since=now - 7.0), policy, now)
    assert verdict.hung and verdict.kind == "device" and "7.0s" in verdict.where
    assert not judge(_marks(now, device_since=0.0), policy, now).hung
    # Before any interval is known the patient bound holds (compilation, warm-up).
    assert not judge(_marks(now, slowest=0.0, device_since=now - 60.0), policy, now).hung
    # Outside the training function nothing is judged.
    assert not judge(_marks(now, progress=0, device_since=now - 60.0), policy, now).hung


# On NCCL, a rank waiting in a collective for a slow but healthy peer (rank 0
# evaluating alone) has device work pending as long as the peer is away.
# (backend, --hang-timeout, device pending s, slowest commit interval s, hung?)
@pytest.mark.parametrize("backend, timeout, pending, slowest, hung", [
    ("cpu:gloo,cuda:nccl", None, 6.0, 0.2, False),  # the victim of a 6 s pause on rank 0
    ("cpu:gloo,cuda:nccl", None, 60.0, 0.2, False),  # still within the collective timeout (60 s)
    ("cpu:gloo,cuda:nccl", None, 66.0, 0.2, True),  # past it: the ring would have failed by now
    ("nccl", None, 66.0, 0.2, True),
    ("gloo", None, 6.0, 0.2, True),  # gloo leaves no device work behind a peer: 5 s floor
    ("cpu:gloo,cuda:nccl", 8.0, 9.0, 0.2, True),  # --hang-timeout is the user's bound
])
def test_the_device_verdict_waits_past_the_collective_timeout_on_nccl(backend, timeout, pending, slowest, hung):
    policy, now = HangPolicy(timeout=timeout, device_floor=device_floor(backend, 60.0)), 1000.0
    verdict = judge(_marks(now, slowest=slowest, device_since=now - pending), policy, now)
    assert verdict.hung is hung and (not hung or verdict.kind == "device")
