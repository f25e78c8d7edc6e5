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

Everything CUDA goes through ``CudaOps``, so the ordering is tested on the CPU with fakes;
without CUDA nothing here runs (``Snapshot`` copies host tensors itself). This module
imports torch only.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

ENV = "ELASTIC_OVERLAP_COMMIT"

WAIT, PROMOTE, DISCARD = "wait", "promote", "discard"

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

    def install(self, optimizer, before: Callable[[], None] = lambda: None) -> None:
        """Every ``optimizer.step()`` first calls ``before()``, then passes the gate (once
        per optimizer)."""
        if optimizer is None or id(optimizer) in self._installed:
            return

        def hook(*_) -> None:  # None: the step's arguments stay as they are
            before()
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

    def install(self, optimizer) -> None:
        """The optimizer's steps settle a completed capture, then wait for the copy in flight."""
        self.gate.install(optimizer, before=lambda: self.settle_if_done())

    def copy(self, views: list, srcs: list) -> list:
        """Queue the copies of ``srcs`` into ``views``; the events that end them."""
        self._ring = self.ring_of_capture()
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
