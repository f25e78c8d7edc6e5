"""Entering a round whose store is dead, against a fake control channel (no etcd).

A round's store is its rank 0's agent. When that agent is gone (a lost host) or
stopped (a paused host), a worker that tries to connect must notice a newer plan
and move to it within about one connect attempt (1 s), not after --rdzv-timeout.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time

import pytest
import torch.distributed as dist

from elastic.worker import recovery, round_store
from elastic.contract.devices import capability
from elastic.contract.errors import PeersUnreachable
from elastic.contract.events import EventLog
from elastic.contract.reset_budget import ResetBudget
from elastic.contract.worker_config import WorkerConfig
from elastic.worker.commit_gate import Monitors
from elastic.worker.outcome import Broken
from elastic.worker.ring_entry import Arrival, RingEntry
from elastic.worker.step_log import StepLog
from elastic.rendezvous import JobStatus, RoundPlan
from elastic.rendezvous.rounds import Slot
from tests.fakes.jobs import wait_until
from tests.fakes.ring import FakeRing

WORKER = "m.w0"
ATTEMPT_S = 1.0  # one connect attempt (elastic/worker/round_store.py)


class FakeControl:
    """The worker's view of the control channel: the newest plan and the status."""

    def __init__(self, plan):
        self._cond = threading.Condition()
        self.plan, self.status = plan, JobStatus()
        self.requests = []  # (worker, round) of every reset request

    def publish(self, plan):
        with self._cond:
            self.plan = plan
            self._cond.notify_all()

    def wait_for(self, predicate, timeout):
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.plan, self.status), timeout)

    def request_reset(self, worker_id, round_number, reason, lost=()):
        self.requests.append((worker_id, round_number))


def plan(round_number, store_addr, workers=(WORKER,)):
    return RoundPlan(round=round_number, slots=tuple(Slot("m", w) for w in workers),
                     hosts={"m": ("h", "127.0.0.1")}, store_addr=store_addr, created=time.time())


CONFIG = WorkerConfig(job_id="j", endpoints="127.0.0.1:1", worker_id=WORKER, member_id="m", host_id="h",
                      round=1, rdzv_timeout=600.0, collective_timeout=60.0)
NO_ETCD = type("NoEtcd", (), {"get": staticmethod(lambda key: None)})()


def make_entry(control, **config) -> RingEntry:
    """A worker's way into rounds, as its session builds it, on ``control``."""
    events = EventLog(None, host="h")
    return RingEntry(WorkerConfig(**{**CONFIG.__dict__, **config}), control, NO_ETCD, events,
                     Monitors(StepLog(events, WORKER)), capability("gloo"), local_rank=0)


@pytest.fixture
def entries():
    """Makes entries; leaves their rings and restores the environment afterwards."""
    saved = dict(os.environ)  # _take_position sets torchrun's variables
    made = []
    yield lambda control, **config: made.append(make_entry(control, **config)) or made[-1]
    for entry in made:
        entry.leave_held()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def live_store():
    """A store that answers, as rank 0's agent serves it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    yield f"127.0.0.1:{store.port}"
    del store


def refusing_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def paused_store():
    """A port that accepts connections (the kernel does, for a listening socket) and never
    answers: the store of an agent that is stopped (SIGSTOP, a paused VM)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


def enter_in_thread(entry, first):
    """Run ``entry.enter(first)`` in a thread (a hang must not hang the test run)."""
    outcome = {}

    def enter():
        try:
            outcome["ring"] = entry.enter(first, previous_plan=None)
            outcome["round"] = outcome["ring"].round
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome["error"] = exc

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("dead", ["refusing", "not-answering"])
def test_a_worker_leaves_a_dead_store_for_a_newer_plan_within_one_attempt(entries, live_store, paused_store, dead,
                                                                          monkeypatch):
    dead_addr = f"127.0.0.1:{refusing_port()}" if dead == "refusing" else paused_store
    control = FakeControl(plan(2, dead_addr))
    entry = entries(control)
    attempting = threading.Event()
    real_client = round_store.client

    def client(host, port, *args, **kwargs):
        attempting.set()
        return real_client(host, port, *args, **kwargs)

    monkeypatch.setattr(round_store, "client", client)
    thread, outcome = enter_in_thread(entry, control.plan)
    assert attempting.wait(10), "the worker never tried the store of round 2"
    published = time.monotonic()
    control.publish(plan(3, live_store))
    thread.join(30)
    moved_after = time.monotonic() - published
    assert not thread.is_alive(), f"still connecting to the {dead} store of round 2 after 30 s"
    assert outcome.get("round") == 3 and "error" not in outcome, outcome
    print(f"\n{dead}: in round 3 {moved_after:.2f}s after it was planned")
    # One attempt to give up, one to connect, with slack for a loaded machine.
    assert moved_after < 2 * ATTEMPT_S + 2.0, f"moved to round 3 only {moved_after:.1f}s after it was planned"


def test_a_store_that_never_answers_is_given_up_after_one_attempt(entries, paused_store):
    """No newer plan: the worker keeps trying (bounded by --rdzv-timeout), one bounded
    attempt at a time; here the connect attempts return, so the loop sees the deadline."""
    control = FakeControl(plan(2, paused_store))
    entry = entries(control, rdzv_timeout=2.5)
    started = time.monotonic()
    thread, outcome = enter_in_thread(entry, control.plan)
    thread.join(30)
    assert not thread.is_alive(), "blocked on a store that never answers"
    assert "unreachable for 2.5s" in str(outcome.get("error")), outcome
    assert time.monotonic() - started < 2.5 + 2 * ATTEMPT_S + 2.0


def test_after_a_round_failed_to_form_the_worker_asks_for_the_next_one(entries, live_store, monkeypatch):
    """A round whose init failed with no newer plan in sight (a peer arrived, then never
    published its address): the worker asks for a round after it and waits for one.
    Entering the failed round again would re-use its store namespace, which hangs."""
    two = plan(2, live_store, workers=(WORKER, "m.w1"))
    control = FakeControl(two)
    entry = entries(control, collective_timeout=2.0)
    host, port = live_store.rsplit(":", 1)
    peer = dist.PrefixStore("/round/2/", dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                                       timeout=datetime.timedelta(seconds=10)))
    peer.add("arrived", 1)  # ... and then it dies
    attempt, tried = recovery._try_reform(entry, None, lambda: two, previous_plan=None, tried=0)
    assert isinstance(attempt, Broken) and isinstance(attempt.unreachable, PeersUnreachable) and tried == 2
    entered = []
    arrived = lambda p: entered.append(p.round) or Arrival(p, None, None, 0.0, 0.0)  # noqa: E731
    monkeypatch.setattr(entry, "arrive", arrived)  # the round it waited for
    monkeypatch.setattr(entry, "form", lambda arrival, previous_plan: FakeRing(round=arrival.plan.round))
    session = type("Session", (), {"entry": entry})()
    formed = {}
    thread = threading.Thread(target=lambda: formed.update(ring=recovery._retry(
        session, attempt, attempt, tried, None, ResetBudget(limit=5, window_s=60))[0]), daemon=True)
    thread.start()
    wait_until(lambda: control.requests, 10, "the worker's request for a round after round 2")
    assert control.requests == [(WORKER, 2)] and entered == [], (control.requests, entered)
    control.publish(plan(3, live_store))
    thread.join(10)
    assert entered == [3] and formed["ring"].round == 3
    # The failed init took a group name (torch numbers them, and only destroying a
    # group gives the numbers back): the next group must be named as in a fresh
    # process (a joiner's), or their inits look for each other under different keys.
    monkeypatch.undo()
    entry.enter(plan(3, live_store), previous_plan=None)
    assert dist.group.WORLD.group_name == "0"


def test_a_loss_announced_during_the_init_aborts_the_ring_it_forms(entries, live_store, monkeypatch):
    # The abort landed on the forming handle only; the formed ring went on (docs/gpus.md).
    control = FakeControl(plan(2, live_store))
    entry = entries(control)
    real_init = dist.init_process_group

    def init_and_a_loss_meanwhile(*args, **kwargs):
        real_init(*args, **kwargs)
        control.publish(RoundPlan(round=3, slots=(Slot("m", WORKER),), hosts={"m": ("h", "127.0.0.1")},
                                  store_addr=live_store, created=time.time(), lost=("m.w9",), recovers=True))
        entry.cell.on_control(control.plan, control.status)  # the control thread's delivery

    monkeypatch.setattr(dist, "init_process_group", init_and_a_loss_meanwhile)
    thread, outcome = enter_in_thread(entry, control.plan)
    thread.join(60)
    assert outcome.get("round") == 2, outcome
    assert outcome["ring"].handle.aborted


def test_a_stale_nccl_dump_signal_is_gone_before_the_rounds_group_forms(entries, live_store, monkeypatch):
    # An earlier ring's watchdog left "exception_dump" in the job-wide store
    # (below every /round/<n>/ prefix); this process's first NCCL group would read it and
    # SIGABRT minutes later. It must be gone when init_process_group starts.
    host, port = live_store.rsplit(":", 1)
    job_store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=10))
    job_store.set(round_store.DUMP_SIGNAL_KEY, b"\x01\x00\x00\x00")
    control = FakeControl(plan(2, live_store))
    entry = entries(control)
    seen_at_init = []
    real_init = dist.init_process_group

    def init(*args, **kwargs):
        seen_at_init.append(job_store.check([round_store.DUMP_SIGNAL_KEY]))
        real_init(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", init)
    thread, outcome = enter_in_thread(entry, control.plan)
    thread.join(60)
    assert outcome.get("round") == 2, outcome
    assert seen_at_init == [False]
    assert not job_store.check([round_store.DUMP_SIGNAL_KEY])


def test_clearing_the_dump_signal_never_stops_a_round_entry():
    class Refusing:
        def delete_key(self, key):
            raise dist.DistStoreError("store going away")

    assert round_store.clear_dump_signal(Refusing(), 3) is False
    store = dist.HashStore()
    assert round_store.clear_dump_signal(store, 3) is False
    store.set(round_store.DUMP_SIGNAL_KEY, "x")
    assert round_store.clear_dump_signal(store, 3) is True and not store.check([round_store.DUMP_SIGNAL_KEY])


def test_a_round_leaves_the_processs_excepthook_as_it_was(entries, live_store):
    # torch's init_process_group wraps sys.excepthook at every call: after 22 re-formations
    # every traceback line carried 22 "[rank0]:" prefixes, wrong once the rank changed.
    control = FakeControl(plan(2, live_store))
    entry = entries(control)
    before = sys.excepthook
    thread, outcome = enter_in_thread(entry, control.plan)
    thread.join(60)
    assert outcome.get("round") == 2, outcome
    assert sys.excepthook is before
