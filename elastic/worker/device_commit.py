"""The worker's side of commits that do not drain the device (opt-in: docs/gpus.md).

``checkpoint/device_snapshot.py`` overlaps a commit's device-to-host copy with the next
step. The worker's part: which ring a capture is made on (asked again when its copy has
completed), no device sync in the commit's ring check, and one sync at a commit where
the ring is left on purpose (a planned switch or stop), so that the ring's abort there
(ring_abort.leave_ring) never ends a kernel of the committed step.

Whether a given commit's copy may overlap at all (a CUDA-graph capture or replay of the
step would write past the optimizer's step pre-hook: gpu-3 N8) is decided at each copy
by ``device_snapshot.copy_mode``; ``prepare`` tells it whether the optimizer's step can be
captured (``device_snapshot.replayable``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from elastic.checkpoint import device_snapshot

from ..contract.devices import Capability
from .ring_abort import check_ring, failed_reason


def drains_at_commit(capability: Capability) -> bool:
    """Does a commit sync the device before its ring check (NCCL, unless overlapped)?"""
    return capability.nccl and not device_snapshot.overlapped()


def prepare(snapshot, optimizer, ring: Callable[[], object]) -> None:
    """Called by ``State.save`` before each capture: give ``snapshot`` the overlapped copy
    (or take it away). ``ring``: how to get the ring the capture is made on (a
    ``RingView``; asked only when on)."""
    if not (device_snapshot.overlapped() and torch.cuda.is_available()):
        snapshot.overlap = None
        return
    overlap = snapshot.overlap or device_snapshot.OverlappedCopy()
    overlap.guarded = device_snapshot.guarded_pointers(optimizer)
    overlap.install(optimizer)  # also reads whether its steps can be captured and replayed
    overlap.ring_of_capture = lambda handle=ring().handle: ring_state(handle)
    snapshot.overlap = overlap


def ring_state(handle) -> Callable[[], Optional[str]]:
    """What the capture's ring says later: why it failed, or None. A ring left on purpose
    (a planned switch aborts it: ring_abort.leave_ring) did not fail."""
    return lambda: failed_reason(handle)


def before_planned_leave(ring) -> None:
    """At the commit where ``ring`` is left on purpose: with overlapped commits, wait for
    the step's kernels and check the ring now (RingBroken, a ring failure, if it broke:
    the recovery path rolls back), before the leave's abort could end one of them."""
    if ring.capability.nccl and device_snapshot.overlapped():
        check_ring(ring.handle, device_sync=True)
