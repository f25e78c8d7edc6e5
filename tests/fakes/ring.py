"""Rings for tests: a ``FakeRing`` with the facts a state asks of its ring, and a real ``Ring``
on a fake control channel and an in-memory store.

``FakeRing`` satisfies ``elastic.worker.ring_view.RingView`` (``test_ring_view.py`` checks
it): a state syncs on it (``state.sync(ring)``), and ``installed(ring)`` makes it the
process's ring for ``state.commit()``. Its commit is the world of one's (the capture, then
the verdict the test queued); ``broken`` is what ``broken_reason()`` says.

``real_ring(...)`` is a ``Ring`` as ``ring_entry.py`` builds one, for tests of the commit's
own steps (the ring check, the switch decision): only its control channel and store are
stand-ins.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, Optional

from elastic.contract.devices import capability
from elastic.contract.events import EventLog
from elastic.contract.worker_config import WorkerConfig
from elastic.rendezvous import JobStatus, RoundPlan
from elastic.rendezvous.rounds import Slot
from elastic.worker import lifecycle
from elastic.worker.commit_gate import Monitors, Verdict
from elastic.worker.ring import Ring
from elastic.worker.ring_abort import RingHandle
from elastic.worker.ring_view import Position
from elastic.worker.session import WorkerSession
from elastic.worker.step_log import StepLog

TEST_CONFIG = WorkerConfig(job_id="test", endpoints="", worker_id="w0", member_id="m", host_id="h", round=1)


class Recorder:
    """An events log that keeps what was emitted: [(name, fields)]."""

    def __init__(self):
        self.emitted: list[tuple[str, dict]] = []
        self.rank = self.round = None

    def emit(self, name: str, **fields) -> None:
        self.emitted.append((name, fields))


class FakeRing:
    """A ring whose facts the test sets (a ``RingView``)."""

    def __init__(self, *, round: int = 1, rank: int = 0, world_size: int = 1, backend: str = "gloo",  # noqa: A002
                 plan: Optional[RoundPlan] = None, previous_plan: Optional[RoundPlan] = None,
                 config: WorkerConfig = TEST_CONFIG, events=None, handle=None, broken: Optional[str] = None,
                 verdicts: Iterable[Verdict] = (), change_ready: bool = False):
        self.round, self.rank, self.world_size = round, rank, world_size
        self.local_rank, self.local_world_size = 0, world_size
        self.capability = capability(backend)
        self.plan, self.previous_plan = plan, previous_plan
        self.config = config
        self.events = events if events is not None else EventLog(None, host="test")
        self.handle = handle
        self.broken = broken
        self.verdicts = list(verdicts)
        self.change_ready = change_ready
        self.sampler = None
        self.calls: list[str] = []  # begin, abort, abort_device, leave(failed)
        self.progress_board = None

    @property
    def backend(self) -> str:
        return self.capability.backend

    @property
    def position(self) -> Position:
        return Position(self.plan, self.rank, self.world_size, self.local_rank, self.local_world_size)

    def commit(self, capture: Callable) -> Verdict:
        capture(self)
        return self.verdicts.pop(0) if self.verdicts else Verdict.CONTINUE

    def publish_check(self):
        return None

    def ring_change_ready(self) -> bool:
        return self.change_ready

    def follow_sampler(self, sampler) -> None:
        self.sampler = sampler

    def broken_reason(self) -> Optional[str]:
        return self.broken

    def begin(self) -> None:
        self.calls.append("begin")

    def abort(self) -> None:
        self.calls.append("abort")

    def abort_device(self) -> None:
        self.calls.append("abort_device")

    def leave(self, failed: bool) -> None:
        self.calls.append(f"leave({failed})")


@contextlib.contextmanager
def installed(ring):
    """``ring`` as this process's ring (``lifecycle.ring()``), for ``state.commit()``."""
    lifecycle.install(WorkerSession.serving(ring))
    try:
        yield ring
    finally:
        lifecycle.install(None)


def plan(round_number: int, workers=("m.w0",), store_addr: str = "127.0.0.1:1", **fields) -> RoundPlan:
    return RoundPlan(round=round_number, slots=tuple(Slot("m", w) for w in workers),
                     hosts={"m": ("h", "127.0.0.1")}, store_addr=store_addr, created=time.time(), **fields)


class FakeControl:
    """The control channel as a ring's gate reads it: the newest plan and the status."""

    def __init__(self, newest: Optional[RoundPlan], status: JobStatus = JobStatus()):
        self.plan, self.status = newest, status


class DictStore:
    """The calls a ring's gate makes on the round's PrefixStore."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def real_ring(handle=None, *, round_plan: Optional[RoundPlan] = None, rank: int = 0, backend: str = "gloo",
              control: Optional[FakeControl] = None, events=None, config: WorkerConfig = TEST_CONFIG,
              etcd=None, exchange=lambda words: lambda: words) -> Ring:
    """A ``Ring`` with ``handle`` (a ``RingHandle``; default: one without connections) on a
    fake control channel (``etcd``: for its publish check); ``exchange`` stands for the
    switch point's broadcast (default: a world whose rank 0 hears itself)."""
    round_plan = round_plan or plan(1)
    events = events if events is not None else EventLog(None, host="test")
    steps = StepLog(events, config.worker_id)
    monitors = Monitors(steps, control=control or FakeControl(round_plan))
    position = Position(round_plan, rank, round_plan.world_size, 0, round_plan.world_size)
    return Ring(plan=round_plan, previous_plan=None, position=position, capability=capability(backend),
                handle=handle if handle is not None else RingHandle(frozenset()), monitors=monitors,
                config=config, events=events, etcd=etcd, exchange=exchange)
