"""This host's workers: the ids the agent offers the job, the processes it runs, their device slots.

What torch's agent calls its ``WorkerGroup``. A worker id is offered once (``wanted``);
a lost worker's replacement gets a new id, so the coordinator tells a replacement from
the worker it replaces. ``running`` holds the processes by worker id (a torchrun-style
worker restarted for a new round keeps its id: its pid tells the two apart).
"""

from __future__ import annotations

from typing import Optional

from .device_slots import DeviceSlots
from .workers import WorkerProcess, WorkerTemplate


class LocalWorkers:
    def __init__(self, member_id: str, nproc: int, template: "WorkerTemplate"):
        self._member_id = member_id
        self.template = template  # forks workers with torch imported (warm_start.py)
        self._next = 0
        self.wanted: list[str] = []  # worker ids we offer, in local order
        self.running: dict[str, WorkerProcess] = {}
        self.slots = DeviceSlots(nproc)  # GPU index / LOCAL_RANK of each live process
        self._elastic_seen = False

    def new_id(self) -> str:
        worker_id = f"{self._member_id}.w{self._next}"
        self._next += 1
        return worker_id

    def offer(self, count: int) -> tuple[str, ...]:
        """Offer ``count`` fresh workers (the agent's start)."""
        self.wanted = [self.new_id() for _ in range(count)]
        return tuple(self.wanted)

    def replace(self, worker_id: str, *, with_new: bool) -> Optional[str]:
        """Stop offering ``worker_id``; offer a new worker in its place if ``with_new``."""
        self.wanted.remove(worker_id)
        if not with_new:
            return None
        self.wanted.append(self.new_id())
        return self.wanted[-1]

    def remove(self, worker_id: str) -> WorkerProcess:
        """Forget an exited (or restarted) worker's process, remembering whether it was elastic."""
        proc = self.running.pop(worker_id)
        self._elastic_seen = self._elastic_seen or proc.elastic
        return proc

    def alive(self) -> list[str]:
        return [w for w, p in self.running.items() if p.alive]

    def any_alive(self) -> bool:
        return any(p.alive for p in self.running.values())

    @property
    def script_is_elastic(self) -> bool:
        """One of our workers called ``elastic.init()``: every worker runs the same script,
        so the job's workers use the elastic runtime (no torchrun store needed). Once
        seen, it stays so (the marker of a process that exited is gone with it)."""
        if not self._elastic_seen:
            self._elastic_seen = any(p.elastic for p in self.running.values())
        return self._elastic_seen
