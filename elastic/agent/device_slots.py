"""Which device slot (GPU index, ``LOCAL_RANK``) each worker process of this host holds.

A worker gets its slot when its agent starts it and keeps it for the life of the
process: its CUDA device is chosen once, before any process group exists, and its
model and optimizer live there. So a slot is never derived from the round's plan
(whose order of a host's workers changes when one is lost), and it is never given
to a new process while the process that held it may still be alive: a process in
the driver's D state keeps its GPU memory until it is reaped. A slot is free again
only once the agent has seen its holder exit.

``free_slot`` is the decision (pure, tested as a table); ``DeviceSlots`` is the
agent's record of who holds what, keyed by pid because a restarted torchrun-style
worker keeps its worker id while its old process may still be on the way out.
"""

from __future__ import annotations

import logging
from typing import Callable, Collection, Iterable, Optional

log = logging.getLogger(__name__)


class SlotConflict(RuntimeError):
    """Two live processes of one host on the same slot: a bug, never a fault to ride out."""


def free_slot(size: int, held: Collection[int]) -> Optional[int]:
    """The lowest slot in ``[0, size)`` not in ``held``; None when every slot is held."""
    return next((slot for slot in range(size) if slot not in held), None)


def check_distinct(slots: Iterable[tuple[str, int]], size: int) -> None:
    """Raise ``SlotConflict`` unless the (worker, slot) pairs of one host's live workers
    name each slot at most once, all within ``[0, size)``."""
    seen: dict[int, str] = {}
    for worker, slot in slots:
        if not 0 <= slot < size:
            raise SlotConflict(f"worker {worker} holds slot {slot}, outside [0, {size})")
        if slot in seen:
            raise SlotConflict(f"workers {seen[slot]} and {worker} both hold device slot {slot}")
        seen[slot] = worker


class DeviceSlots:
    """The slots of this host's worker processes that the agent has not seen exit."""

    def __init__(self, size: int):
        self.size = size
        self._holders: dict[int, tuple[int, str]] = {}  # slot -> (pid, worker id)
        self._awaiting: list[str] = []  # workers to start once a slot is free, in order

    def free(self) -> Optional[int]:
        return free_slot(self.size, self._holders)

    def claim(self, worker: str) -> Optional[int]:
        """The slot to start ``worker`` on, or None: every slot is held by a process not
        seen to exit yet, and ``worker`` waits (``awaiting``) until one has."""
        slot = self.free()
        if slot is None and worker not in self._awaiting:
            log.warning("%s waits for a device slot: every one is held (%s)", worker, self.held())
            self._awaiting.append(worker)
        elif slot is not None and worker in self._awaiting:
            self._awaiting.remove(worker)
        return slot

    def awaiting(self, still_wanted: Callable[[str], bool]) -> list[str]:
        """The waiting workers that ``still_wanted``, to start now (the others are forgotten),
        while a slot is free."""
        self._awaiting = [w for w in self._awaiting if still_wanted(w)]
        return list(self._awaiting) if self.free() is not None else []

    def hold(self, slot: int, pid: int, worker: str) -> None:
        """``pid`` (of worker ``worker``) was started on ``slot``."""
        if slot in self._holders:
            other_pid, other = self._holders[slot]
            raise SlotConflict(f"slot {slot} given to {worker} (pid {pid}) while {other} (pid {other_pid}) holds it")
        check_distinct([*((w, s) for s, (_, w) in self._holders.items()), (worker, slot)], self.size)
        self._holders[slot] = (pid, worker)

    def release(self, pid: int) -> Optional[int]:
        """The process ``pid`` has exited: its slot (if it held one) is free again."""
        for slot, (holder, _) in list(self._holders.items()):
            if holder == pid:
                del self._holders[slot]
                return slot
        return None

    def held(self) -> dict[int, str]:
        """slot -> worker id, for logs and tests."""
        return {slot: worker for slot, (_, worker) in self._holders.items()}
