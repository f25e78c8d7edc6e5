"""The buffers a sharded commit lives in: one shard of one commit, flat per dtype, reused.

A ``ShardSlot`` holds shard ``shard`` of commit ``commit`` made by a ring of ``world``
workers: every sharded tensor's rows of that shard, laid one after the other in one
flat buffer per dtype. A worker keeps its own shard of the last commit in one slot and
the shards it keeps for other ranks (replicas) in others. Slots are reused while the
layout stays (``reusable``): a commit every step allocates nothing, and the views of
a slot shaped like the live local tensors are made once (``copy_from``).

A slot that copies from CUDA tensors has its buffers page-locked at its first such copy
(registered in place at their exact size: ``checkpoint/host_pinning.py``, the way
snapshots do it; ``pin_memory=True`` would round each up to a power of two), so the
copies run asynchronously at the device's bandwidth, and the slot waits once per commit
for all of them instead of once per tensor. Where the driver refuses, the buffers stay
pageable and the copies synchronous, as before.

``Replication`` moves a commit's shards to their replica holders in the background:
every message is posted at the commit (``isend``/``irecv`` straight from and into the
slots' buffers) and a thread waits for them, so the copy overlaps the next step; the
next commit waits for what is left. A copy counts only once its receive has completed.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from elastic.checkpoint import host_pinning

from ..worker.sync_plan import CommitId
from .reshard_plan import TensorLayout

log = logging.getLogger(__name__)

# Replica messages are tagged apart from a re-shard's (which count from 0 per pair).
_REPLICA_TAG = 1 << 28
_pageable_logged = False  # the fall-back to pageable slots said once per process


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class ShardSlot:
    """Shard ``shard`` of ``commit`` (made by a ring of ``world``), flat per dtype."""

    def __init__(self, layout: Sequence[TensorLayout], world: int, shard: int,
                 reuse: Optional["ShardSlot"] = None):
        self.commit: Optional[CommitId] = None  # set once the slot holds a whole shard
        self.world, self.shard = world, shard
        self.layout = tuple(layout)
        self._shaped: tuple[object, list[torch.Tensor]] = (None, [])  # (LiveShards, its views here)
        self.offsets: dict[str, tuple[str, int, int]] = {}  # key -> (dtype, start, length)
        sizes: dict[str, int] = {}
        for tensor in layout:
            length = tensor.shard_elements(world, shard)
            self.offsets[tensor.key] = (tensor.dtype, sizes.get(tensor.dtype, 0), length)
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + length
        if reuse is not None and {d: b.numel() for d, b in reuse.flat.items()} == sizes:
            self.flat = reuse.flat
            self._pins = reuse._pins  # the buffers' page-locking goes with them
        else:
            self.flat = {d: torch.empty(n, dtype=torch_dtype(d), device="cpu") for d, n in sorted(sizes.items())}
            self._pins = HostPins()

    def reusable(self, layout: Sequence[TensorLayout], world: int, shard: int) -> bool:
        """Whether this slot can take shard ``shard`` of a commit of ``layout`` by ``world``."""
        return world == self.world and shard == self.shard and (layout is self.layout or tuple(layout) == self.layout)

    def copy_from(self, live) -> None:
        """Copy ``live``'s local tensors (a ``LiveShards`` of this slot's layout) in, in one call."""
        if self._shaped[0] is not live:
            views = [self.view(key).view(source.shape) for key, source in zip(live.tensors, live.sources)]
            self._shaped = (live, views)
        devices = {source.device for source in live.sources if source.device.type == "cuda"}
        if devices:
            self._pins.pin(self.flat)
        with torch.no_grad():
            torch._foreach_copy_(self._shaped[1], live.sources, non_blocking=bool(devices))
        # One wait per commit for every copy (each on its source device's current stream,
        # after the step's kernels): the slot is complete, and may be sent, only after it.
        for device in devices:
            torch.cuda.current_stream(device).synchronize()

    def forget_sources(self) -> None:
        """Drop the cached views and with them the live tensors they were made for: after
        a failure the broken ring's model must not stay alive through the re-shard."""
        self._shaped = (None, [])

    def view(self, key: str) -> torch.Tensor:
        dtype, start, length = self.offsets[key]
        return self.flat[dtype].narrow(0, start, length)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.flat.values())

    def messages(self) -> list[tuple[int, torch.Tensor]]:
        """(tag, buffer) per non-empty dtype buffer, the same order on both ends."""
        return [(_REPLICA_TAG + i, b) for i, (_, b) in enumerate(sorted(self.flat.items())) if b.numel()]


class HostPins:
    """Which of a set of slot buffers are page-locked (shared by the slots that share the
    buffers). It holds them until it goes, then unlocks them before they can be freed: freed
    memory that is still registered makes a later registration of it fail."""

    def __init__(self):
        self._registered: list[tuple[int, torch.Tensor]] = []
        self._tried = False
        weakref.finalize(self, _unpin, self._registered)

    def pin(self, flat: dict[str, torch.Tensor]) -> None:
        """Page-lock ``flat``'s buffers, once; they stay pageable where the driver refuses."""
        global _pageable_logged
        if self._tried:
            return
        self._tried = True
        for buffer in flat.values():
            if buffer.numel() == 0:
                continue
            if not host_pinning.register(buffer):
                if not _pageable_logged:
                    _pageable_logged = True
                    log.debug("shard slots stay in pageable memory (host registration: %s): their device copies "
                              "are synchronous", host_pinning.refused() or "not available")
                return
            self._registered.append((buffer.data_ptr(), buffer))

    @property
    def pinned(self) -> int:
        """How many buffers are page-locked."""
        return len(self._registered)


def _unpin(registered: list) -> None:
    while registered:
        pointer, _buffer = registered.pop()  # held until unregistered
        try:
            torch.cuda.cudart().cudaHostUnregister(pointer)
        except Exception:  # noqa: BLE001 - at exit CUDA may be gone already
            pass


def slot_for(previous: Optional[ShardSlot], layout: Sequence[TensorLayout], world: int, shard: int) -> ShardSlot:
    """A slot to take shard ``shard`` of a new commit: ``previous`` itself (emptied) while
    its layout fits, else a new one that keeps ``previous``'s buffers where sizes match.
    The caller must no longer count ``previous`` as holding its commit."""
    if previous is not None and previous.reusable(layout, world, shard):
        previous.commit = None
        return previous
    return ShardSlot(layout, world, shard, reuse=previous)


class Replication:
    """One commit's copies in flight: this worker's shard to its holders, others' to it."""

    def __init__(self, commit: CommitId, own: ShardSlot, send_to: Sequence[int],
                 receive: dict[int, ShardSlot], on_complete: Optional[Callable[[], None]] = None):
        """``on_complete``: called on the waiting thread once every copy completed without error."""
        self.commit = commit
        self._on_complete = on_complete
        self.receive = receive  # owner rank -> the slot its shard arrives in
        self.received: set[int] = set()  # owners whose copy has arrived whole
        self.errors: list[BaseException] = []
        self.bytes_sent = 0
        sends, recvs = [], []
        for holder in send_to:
            for tag, buffer in own.messages():
                sends.append(dist.isend(buffer, dst=holder, tag=tag))
                self.bytes_sent += buffer.numel() * buffer.element_size()
        for owner, slot in receive.items():
            recvs.append((owner, [dist.irecv(buffer, src=owner, tag=tag) for tag, buffer in slot.messages()]))
        self._thread = threading.Thread(target=self._wait, args=(sends, recvs), name="shard-replication",
                                        daemon=True)
        self._thread.start()

    def _wait(self, sends, recvs) -> None:
        for owner, works in recvs:
            try:
                for work in works:
                    work.wait()
            except Exception as exc:  # the ring broke: this copy never counts
                self.errors.append(exc)
                continue
            self.receive[owner].commit = self.commit
            self.received.add(owner)
        for work in sends:
            try:
                work.wait()
            except Exception as exc:
                self.errors.append(exc)
        if not self.errors and self._on_complete is not None:
            self._on_complete()

    def finish(self, timeout: Optional[float] = None) -> bool:
        """Wait (at most ``timeout``) for every copy; True when all have completed."""
        self._thread.join(timeout)
        return not self._thread.is_alive() and not self.errors
