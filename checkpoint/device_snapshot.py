"""Commits on GPUs that do not drain the device: the snapshot's copy overlaps the next step.

Opt-in (``ELASTIC_OVERLAP_COMMIT=1``, see docs/gpu-commits.md). Without it a commit on an
NCCL ring syncs the training stream (to see the step's collectives end without error),
then the training stream waits for the whole device-to-host copy: about one PCIe copy
of the state per commit (gpu review G13). With it:

* the copy is ordered after the step's last kernel by the side stream waiting for the
  training stream (an event, on the device), and the host does not wait;
* the training stream waits at once only for the copies of the tensors the next step's
  forward may write (module buffers: BatchNorm statistics, anything not the optimizer's);
  the copies of the parameters and the optimizer's state, the bulk, are waited for by the
  next ``optimizer.step()`` (a step pre-hook: a device-side wait, ``WriteGate``), so they
  overlap the next forward and backward;
* the capture becomes the rollback target once its copy has completed and the ring it
  was made on was not broken by a failure (``promotion``); else the previous capture stays
  the target. The ring is asked then, not before the copy: an abort sets the ring's flag
  before the kernels it ends can let the copy run, so a copy of weights that an aborted
  all-reduce left half-reduced is never promoted.

The rule a script must keep: between commits, the parameters and the optimizer's state
are written by ``optimizer.step()`` only (the usual loop). A script that writes them
elsewhere (an in-place clamp, an EMA into the parameters) must leave this off.

A step that writes them without calling ``optimizer.step()`` would race the copy
silently: a CUDA-graph replay of a captured step, a fused step called directly (gpu
review gpu-3 N8). Where that can be seen, a commit's copy drains instead
(``copy_mode``): the commit runs while the current stream captures a CUDA graph; the
step pre-hook ran during a capture (the replays never call it); or the optimizer's step
can be captured (``replayable``) and no step went through the hook since the previous
commit, or this is the first commit (before the hook could see a step). Each reason is
logged once, the first time it drains a copy; the first commit drains quietly.

Everything CUDA goes through ``CudaOps``, so the ordering is tested on the CPU with fakes;
without CUDA nothing here runs (``Snapshot`` copies host tensors itself). This module
imports torch only.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

log = logging.getLogger(__name__)

ENV = "ELASTIC_OVERLAP_COMMIT"

WAIT, PROMOTE, DISCARD = "wait", "promote", "discard"

# How a commit's copy runs with overlap on (``copy_mode``): OVERLAP, or drained for a reason.
OVERLAP = "overlap"
CAPTURING = "capturing"  # the commit itself runs inside a CUDA-graph capture
CAPTURED = "captured"  # the optimizer's step was captured: its replays never call the hook
BYPASSED = "bypassed"  # a replayable optimizer, and no step through the hook since the last commit
UNSEEN = "unseen"  # a replayable optimizer, and the first commit since the hook was installed
# What the log says, once per reason, the first time a copy drains for it. UNSEEN is no
# evidence of anything (the first commit after the hook was installed): drained quietly.
DRAIN_REASONS = {
    CAPTURING: "the commit runs while the current CUDA stream is capturing a graph",
    CAPTURED: "the optimizer's step was captured into a CUDA graph, and its replays never call optimizer.step()",
    BYPASSED: "no optimizer.step() went through its step pre-hook since the previous commit, and its step can be "
              "captured into a CUDA graph: either no step ran (a commit right after a restore), or the step "
              "bypassed optimizer.step() (a graph replay, a fused step called directly) and would race the copy",
}

# What a capture's ring says when asked: why it failed (aborted for a failure, an error
# NCCL reported), or None while it has not.
RingState = Callable[[], Optional[str]]


def overlapped(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Did the user ask for commits that do not drain the device?"""
    return (os.environ if environ is None else environ).get(ENV, "0").strip() == "1"


def promotion(copied: bool, ring_failure: Optional[str]) -> str:
    """What becomes of a capture in flight: WAIT while its copy runs; then PROMOTE (it
    is the rollback target) unless the ring it was made on failed, then DISCARD (the
    previous capture stays the target: the copy may hold half-reduced weights)."""
    if not copied:
        return WAIT
    return PROMOTE if ring_failure is None else DISCARD


def copy_mode(*, capturing: bool, step_captured: bool, replayable: bool, hooked_steps: Optional[int]) -> str:
    """How a commit's copy runs with overlap on: OVERLAP (the next ``optimizer.step()``
    waits for it), or the reason it drains (the training stream waits for all of it).

    Overlap is safe only if the next write to the parameters passes the step pre-hook.
    ``capturing``: the current stream captures a CUDA graph now. ``step_captured``: the
    hook ran during a capture (a graph holds the step; replays skip the hook).
    ``replayable``: the optimizer's step can be captured (``replayable``), so a step the
    hook never saw may have run. ``hooked_steps``: the steps that went through the hook
    since the previous commit's copy (None: this is the first copy, made right after the
    hook was installed, so nothing is known yet). An optimizer whose step torch refuses
    to capture has no replay to fear: a commit with no step before it overlaps."""
    if capturing:
        return CAPTURING
    if step_captured:
        return CAPTURED
    if replayable and hooked_steps is None:
        return UNSEEN
    if replayable and hooked_steps == 0:
        return BYPASSED
    return OVERLAP


def replayable(optimizer) -> bool:
    """Can ``optimizer``'s step be captured into a CUDA graph, and so replayed without
    calling ``optimizer.step()``? torch refuses to capture the step of an optimizer
    that has a ``capturable`` option unless every param group sets it True (Adam,
    AdamW, ...: ``_accelerator_graph_capture_health_check``); one without the option
    (SGD) is captured without a check."""
    groups = optimizer.param_groups if optimizer is not None else []
    return bool(groups) and all(group.get("capturable", True) for group in groups)


def stream_capturing() -> bool:
    """Is the current CUDA stream capturing a graph? False without CUDA."""
    if not torch.cuda.is_available():
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:  # a build or a device that cannot answer: no capture can run there either
        return False


class CudaOps:
    """The CUDA calls the overlapped copy makes (a fake stands in on the CPU)."""

    def __init__(self) -> None:
        self._side: dict = {}

    def side_stream(self, device):
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = torch.cuda.Stream(device=device)
        return stream

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def event(self):
        return torch.cuda.Event()


class WriteGate:
    """The device-side wait that the next write to the snapshotted tensors owes their copy."""

    def __init__(self, ops) -> None:
        self._ops = ops
        self._held: dict = {}  # device -> the event of the copy still reading its tensors
        self._installed: set = set()  # ids of the optimizers whose step waits here

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def hold(self, device, event) -> None:
        self._held[device] = event

    def before_write(self) -> None:
        """Make each device's current stream wait for the copy (on the device; the host goes on)."""
        held, self._held = self._held, {}
        for device, event in held.items():
            self._ops.current_stream(device).wait_event(event)

    def install(self, optimizer, before: Callable[[], bool] = lambda: True) -> None:
        """Every ``optimizer.step()`` first calls ``before()``, then passes the gate unless
        ``before()`` says the step does not run now (it is being captured into a CUDA
        graph: recorded, not run, and a wait on an event from outside the capture would
        break it). Installed once per optimizer."""
        if optimizer is None or id(optimizer) in self._installed:
            return

        def hook(*_) -> None:  # None: the step's arguments stay as they are
            if before():
                self.before_write()

        optimizer.register_step_pre_hook(hook)
        self._installed.add(id(optimizer))


class OverlappedCopy:
    """The device-to-host half of ``Snapshot.capture`` for CUDA tensors, overlapped."""

    def __init__(self, ops=None) -> None:
        self.ops = ops if ops is not None else CudaOps()
        self.gate = WriteGate(self.ops)
        self.guarded: frozenset = frozenset()  # data_ptr()s of the tensors only optimizer.step() writes
        self.ring_of_capture: Callable[[], Optional[RingState]] = lambda: None
        self._ring: Optional[RingState] = None  # the ring the capture in flight was made on
        # Set by the Snapshot: promote (or discard) its capture in flight if its copy has
        # completed, without waiting. Asked at every optimizer step, so that a capture is
        # the rollback target about one step after its commit, not only at the next one.
        self.settle_if_done: Callable[[], None] = lambda: None
        # What tells whether the step pre-hook sees every write (copy_mode, gpu-3 N8).
        self.capturing: Callable[[], bool] = stream_capturing
        self.replayable = False  # the installed optimizer's step can be captured (as of the last install)
        self.step_captured = False  # the hook once ran inside a CUDA-graph capture
        self._hooked_steps: Optional[int] = None  # steps through the hook since the last copy (None: no copy yet)
        self.last_mode: Optional[str] = None  # how the last copy ran (OVERLAP, or why it drained)
        self._told: set = set()  # the drain reasons already logged

    def install(self, optimizer) -> None:
        """The optimizer's steps settle a completed capture, then wait for the copy in flight."""
        self.replayable = replayable(optimizer)
        self.gate.install(optimizer, before=self._before_step)

    def _before_step(self) -> bool:
        """In the step pre-hook: count the step, settle a completed capture; False while
        the step is being captured into a CUDA graph (it does not run now, and its
        replays will never come here: every later copy drains)."""
        if self.capturing():
            self.step_captured = True
            return False
        if self._hooked_steps is not None:
            self._hooked_steps += 1
        self.settle_if_done()
        return True

    def _mode(self) -> str:
        """This copy's mode (``copy_mode``); starts the count of hooked steps for the next one."""
        hooked, self._hooked_steps = self._hooked_steps, 0
        mode = copy_mode(capturing=self.capturing(), step_captured=self.step_captured, replayable=self.replayable,
                         hooked_steps=hooked)
        if mode in DRAIN_REASONS and mode not in self._told:
            self._told.add(mode)
            log.warning("overlapped commits: this commit's copy drains the device, because %s (said once: later "
                        "commits drain for this reason without another line)", DRAIN_REASONS[mode])
        self.last_mode = mode
        return mode

    def copy(self, views: list, srcs: list) -> list:
        """Queue the copies of ``srcs`` into ``views``; the events that end them. Drained
        (the training stream waits for the whole copy) unless ``copy_mode`` says OVERLAP."""
        self._ring = self.ring_of_capture()
        drain = self._mode() != OVERLAP
        by_device: dict = {}
        for dst, src in zip(views, srcs):
            free, held = by_device.setdefault(src.device, ([], []))
            (held if src.data_ptr() in self.guarded else free).append((dst, src))
        events = []
        for device, (free, held) in by_device.items():
            side, current = self.ops.side_stream(device), self.ops.current_stream(device)
            side.wait_stream(current)  # after the step's last kernel, on the device
            with self.ops.on(side):
                for dst, src in free:
                    dst.copy_(src, non_blocking=True)
                freed = self.ops.event()
                freed.record(side)
            # The next forward may write these (BatchNorm statistics): small, waited for now.
            current.wait_event(freed)
            with self.ops.on(side):
                for dst, src in held:
                    dst.copy_(src, non_blocking=True)
                done = self.ops.event()
                done.record(side)
            if drain:  # no write may pass the hook's wait unseen: the training stream waits now
                current.wait_event(done)
            else:
                self.gate.hold(device, done)  # the next optimizer.step() waits for these
            events.append(done)
        return events

    def promotes(self) -> bool:
        """Asked once the capture's copy has completed: does it become the rollback target?"""
        ring, self._ring = self._ring, None
        return promotion(True, ring() if ring is not None else None) == PROMOTE


def guarded_pointers(optimizer) -> frozenset:
    """The storage pointers of what only ``optimizer.step()`` writes: its parameters and
    the tensors of its state (a model's ``state_dict()`` holds views of the same memory)."""
    if optimizer is None:
        return frozenset()
    pointers = set()
    for group in optimizer.param_groups:
        pointers.update(p.data_ptr() for p in group["params"])
    for state in optimizer.state.values():
        pointers.update(v.data_ptr() for v in _tensors(state.values()) if v.is_cuda)
    return frozenset(pointers)


def _tensors(values: Iterable[Any]):
    return (v for v in values if isinstance(v, torch.Tensor))
