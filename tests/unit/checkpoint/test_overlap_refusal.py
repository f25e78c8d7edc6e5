"""Overlapped commits drain where a step could write past the optimizer's step pre-hook
(gpu review gpu-3 N8): a CUDA-graph replay of a captured step, or a step that bypasses
``optimizer.step()``, would race the copy and tear the commit silently. On the CPU with
the fake streams of test_device_snapshot.py; no CUDA needed."""

from __future__ import annotations

import logging

import pytest
import torch

from elastic.checkpoint import device_snapshot
from elastic.checkpoint.device_snapshot import (BYPASSED, CAPTURED, CAPTURING, OVERLAP, UNSEEN, OverlappedCopy,
                                                copy_mode, replayable)
from tests.unit.checkpoint.test_device_snapshot import FakeOps, FakeTensor


# (capturing now, the step hook once ran in a capture, the step can be captured, steps through the hook since the
#  previous commit (None: first commit), the copy's mode)
@pytest.mark.parametrize("capturing, step_captured, can_replay, hooked, mode", [
    (False, False, False, 3, OVERLAP),
    (False, False, False, 0, OVERLAP),  # torch refuses to capture this step: no replay to fear
    (False, False, False, None, OVERLAP),
    (False, False, True, 1, OVERLAP),  # the hook saw the step: the next one waits too
    (False, False, True, 0, BYPASSED),  # replayed, fused past the hook, or no step at all: cannot tell
    (False, False, True, None, UNSEEN),  # first commit: the hook has seen nothing yet
    (False, True, True, 5, CAPTURED),  # the graph's replays will never call the hook
    (False, True, False, 5, CAPTURED),
    (True, False, False, 2, CAPTURING),  # the commit itself is being captured
    (True, True, True, 0, CAPTURING),
])
def test_copy_mode(capturing, step_captured, can_replay, hooked, mode):
    assert copy_mode(capturing=capturing, step_captured=step_captured, replayable=can_replay,
                     hooked_steps=hooked) == mode


def _params():
    return [torch.nn.Parameter(torch.ones(2))]


@pytest.mark.parametrize("make, can_replay", [
    (lambda: torch.optim.SGD(_params(), lr=0.1), True),  # no capturable option: captured unchecked
    (lambda: torch.optim.Adam(_params()), False),  # capturable=False: torch refuses to capture its step
    (lambda: torch.optim.Adam(_params(), capturable=True), True),
    (lambda: _two_groups(True, False), False),  # torch needs every group capturable
    (lambda: _two_groups(True, True), True),
    (lambda: None, False),
])
def test_which_optimizers_steps_can_be_replayed(make, can_replay):
    assert replayable(make()) is can_replay


def _two_groups(first, second):
    return torch.optim.Adam([{"params": _params(), "capturable": first}, {"params": _params(), "capturable": second}])


def _commit(overlap, ops):
    """One commit's copy of a guarded tensor (a parameter): what the training stream waits for now."""
    ops.log.clear()
    overlap.guarded = frozenset({1})
    overlap.copy([FakeTensor("host_weight", 101, ops)], [FakeTensor("weight", 1, ops)])
    return [entry for entry in ops.log if entry[:2] == ("wait_event", "training")]


def _waits_now(waits):
    return len(waits) == 2  # the forward's part (nothing here) and the bulk: a drain


def _step(optimizer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    optimizer.step()


def test_a_step_that_bypasses_the_hook_makes_the_next_commits_drain_with_one_line(caplog):
    ops = FakeOps()
    overlap = OverlappedCopy(ops)
    optimizer = torch.optim.SGD(_params(), lr=0.1)
    overlap.install(optimizer)
    caplog.set_level(logging.WARNING, logger=device_snapshot.__name__)
    assert _waits_now(_commit(overlap, ops)) and overlap.last_mode == UNSEEN and not overlap.gate.holding
    assert not caplog.records  # the first commit drains quietly: no evidence of anything
    _step(optimizer)
    assert not _waits_now(_commit(overlap, ops)) and overlap.last_mode == OVERLAP and overlap.gate.holding
    # Steps that never call optimizer.step() (a graph replay): the next commits drain.
    assert _waits_now(_commit(overlap, ops)) and overlap.last_mode == BYPASSED
    assert _waits_now(_commit(overlap, ops)) and overlap.last_mode == BYPASSED
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no optimizer.step() went through its step pre-hook" in lines[0]
    _step(optimizer)
    assert not _waits_now(_commit(overlap, ops)) and overlap.last_mode == OVERLAP


def test_an_optimizer_whose_step_cannot_be_captured_overlaps_from_the_first_commit():
    ops = FakeOps()
    overlap = OverlappedCopy(ops)
    overlap.install(torch.optim.AdamW(_params()))
    assert not _waits_now(_commit(overlap, ops)) and overlap.last_mode == OVERLAP
    assert not _waits_now(_commit(overlap, ops)) and overlap.last_mode == OVERLAP  # no step between: as before


def test_a_step_captured_into_a_graph_makes_every_later_commit_drain(caplog):
    ops = FakeOps()
    overlap = OverlappedCopy(ops)
    capturing = [False]
    overlap.capturing = lambda: capturing[0]
    optimizer = torch.optim.SGD(_params(), lr=0.1)
    overlap.install(optimizer)
    _commit(overlap, ops)
    _step(optimizer)
    assert not _waits_now(_commit(overlap, ops)) and overlap.gate.holding
    caplog.set_level(logging.WARNING, logger=device_snapshot.__name__)
    capturing[0] = True
    ops.log.clear()
    _step(optimizer)  # torch.cuda.graph's capture: recorded, not run; no wait from outside the capture
    assert ops.log == [] and overlap.gate.holding and overlap.step_captured
    capturing[0] = False
    _step(optimizer)  # an eager step after the capture still counts ...
    assert _waits_now(_commit(overlap, ops)) and overlap.last_mode == CAPTURED  # ... but replays would not
    assert _waits_now(_commit(overlap, ops)) and overlap.last_mode == CAPTURED
    assert len(caplog.records) == 1 and "captured into a CUDA graph" in caplog.records[0].getMessage()


def test_a_commit_made_while_the_stream_captures_drains():
    ops = FakeOps()
    overlap = OverlappedCopy(ops)
    overlap.capturing = lambda: True
    assert _waits_now(_commit(overlap, ops)) and overlap.last_mode == CAPTURING and not overlap.gate.holding


def test_a_torch_that_cannot_say_is_not_capturing(monkeypatch):
    assert device_snapshot.stream_capturing() is False  # no CUDA, or no capture under way in this test

    def cannot_say():
        raise RuntimeError("Tried to instantiate dummy base class _cuda_isCurrentStreamCapturing")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", cannot_say)
    assert device_snapshot.stream_capturing() is False
