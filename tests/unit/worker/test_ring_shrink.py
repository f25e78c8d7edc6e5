"""Shrinking the NCCL communicator after a loss (elastic/worker/ring_shrink.py), on the CPU:
when it shrinks (a table), the shrink in place of the plan's abort (a stand-in NCCL backend
that records it), the next round's group on the shrunk communicator once every worker holds
one (torch's real registry, with a gloo backend standing in for the shrunk NCCL part), and
the fallbacks to today's ``init_process_group``. What only a GPU shows (NCCL's shrink itself,
its time against a new communicator) is not here: docs/gpus.md."""

from __future__ import annotations

import datetime
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from elastic.contract import round_keys
from elastic.contract.devices import CPU_AND_CUDA, capability
from elastic.contract.worker_config import WorkerConfig
from elastic.rendezvous import JobStatus, RoundPlan
from elastic.rendezvous.rounds import Slot
from elastic.worker import nccl_abort, ring_abort, ring_shrink
from elastic.worker.ring_abort import RingHandle
from elastic.worker.ring_entry import Arrival, Forming, RingCell, RingEntry
from elastic.worker.ring_shrink import Groups, ShrunkForNextRound, Support, ranks_to_exclude

W = ("m.w0", "m.w1", "m.w2")
BOTH = capability(CPU_AND_CUDA)
SUPPORTED = Support(torch_shrinks=True, nccl_version=(2, 27, 3), opted_out=False, bounded=True)
TIMEOUT = datetime.timedelta(seconds=30)
HALF_DEADLINE = int(nccl_abort.ABORT_DEADLINE_S // 2)


def plan(round_, workers=W, lost=(), store="10.0.0.1:29400"):
    members = {w.split(".")[0] for w in workers} or {"m"}
    return RoundPlan(round_, tuple(Slot(w.split(".")[0], w) for w in workers), {m: ("h", "10.0.0.1") for m in members},
                     store, 0.0, lost=tuple(lost), recovers=bool(lost))


def support(**changes):
    return Support(**{**SUPPORTED.__dict__, **changes})


# -- when: the decision ----------------------------------------------------------------------
@pytest.mark.parametrize("previous, new, cap, sup, held, excluded", [
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), BOTH, SUPPORTED, True, (1,)),
    (plan(4), plan(5, ("m.w1", "m.w2"), lost=("m.w0",)), BOTH, SUPPORTED, True, (0,)),  # rank 0 lost, same store
    (plan(4), plan(5, ("m.w1",), lost=("m.w0", "m.w2")), BOTH, SUPPORTED, True, (0, 2)),
    (plan(4), plan(5, W, lost=()), BOTH, SUPPORTED, True, None),  # a reset round: everyone stays
    (plan(4), plan(5, ("m.w0", "m.w2", "m.w3"), lost=("m.w1",)), BOTH, SUPPORTED, True, None),  # a replacement
    (plan(4), plan(5, ("m.w2", "m.w0"), lost=("m.w1",)), BOTH, SUPPORTED, True, None),  # survivors re-ranked
    (plan(4), plan(5, ("m.w0", "m.w2")), BOTH, SUPPORTED, True, None),  # w1 left gracefully: not a loss
    (plan(4), plan(5, ("m.w0",), lost=("m.w1",)), BOTH, SUPPORTED, True, None),  # w2 left without being lost
    (plan(4), plan(6, ("m.w0", "m.w2"), lost=("m.w1",)), BOTH, SUPPORTED, True, None),  # a round skipped
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",), store="10.0.0.2:29400"), BOTH, SUPPORTED, True, None),
    (None, plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), BOTH, SUPPORTED, True, None),  # a joiner's first round
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), capability("nccl"), SUPPORTED, True, None),  # no host part
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), capability("gloo"), SUPPORTED, True, None),
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), BOTH, support(nccl_version=(2, 26, 5)), True, None),
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), BOTH, support(nccl_version=None), True, None),
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), BOTH, support(nccl_version=(2, 27, 0)), True, (1,)),
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), BOTH, support(nccl_version=(2, 28, 3, "+cuda12")), True,
     (1,)),
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), BOTH, support(torch_shrinks=False), True, None),
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), BOTH, support(opted_out=True), True, None),
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), BOTH, support(bounded=False), True, None),
    (plan(4), plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), BOTH, SUPPORTED, False, None),  # aborted already
])
def test_when_the_ring_shrinks(previous, new, cap, sup, held, excluded):
    assert ranks_to_exclude(previous, new, cap, sup, communicator_held=held) == excluded


@pytest.mark.parametrize("environ, opted_out, bounded", [
    ({"TORCH_NCCL_USE_COMM_NONBLOCKING": "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "30"}, True, True),  # off by default
    ({ring_shrink.ENV: "1", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "30"}, False,
     True),  # asked for, with the agent's settings
    ({ring_shrink.ENV: "0", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "30"}, True,
     True),
    ({ring_shrink.ENV: "1"}, False, False),  # blocking communicators: a shrink nobody joins never ends
    ({ring_shrink.ENV: "1", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}, False, False),  # torch's 30 minutes
    # A failed shrink's wait and the abort's after it, within the abort's deadline.
    ({ring_shrink.ENV: "1", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
      "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(HALF_DEADLINE - 1)}, False, True),
    ({ring_shrink.ENV: "1", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
      "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(HALF_DEADLINE)}, False, False),
    ({ring_shrink.ENV: "1", "TORCH_NCCL_USE_COMM_NONBLOCKING": "true", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "x"}, False,
     False),
])
def test_what_this_process_allows(environ, opted_out, bounded):
    found = ring_shrink.support_here(environ)
    assert (found.opted_out, found.bounded) == (opted_out, bounded)
    assert found.torch_shrinks  # torch 2.13 has shrink_group
    assert found.nccl_version is None or len(found.nccl_version) >= 3  # None on a CPU build


# -- at the abort: the shrink in its place ---------------------------------------------------
class FakeNccl:
    """The default group's NCCL part: records its shrink and its abort, in order."""

    def __init__(self, journal, *, rank=0, size=3, fails=None, shrinks=True, error="SUCCESS"):
        self.journal, self._rank, self._size = journal, rank, size
        self.fails, self.supports_shrinking, self.error = fails, shrinks, error
        self.shrunk_with = None

    def shrink(self, ranks, flags):
        self.journal.append("shrink")
        self.shrunk_with = (ranks, flags)
        if self.fails is not None:
            raise self.fails
        return FakeNccl(self.journal, rank=self._rank, size=self._size - len(ranks))

    def abort(self):
        self.journal.append("abort")

    def get_error(self):
        return SimpleNamespace(name=self.error)

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class FakeGroup:
    def __init__(self, journal, name):
        self.journal, self.name = journal, name

    def abort(self):
        self.journal.append(f"abort {self.name}")


def test_the_shrink_leaves_out_the_lost_ranks_then_the_groups_are_aborted_as_always():
    journal, kept = [], []
    backend = FakeNccl(journal)
    ring_shrink.shrink_then_abort(backend, (1,), kept.append,
                                  Groups(FakeGroup(journal, "default"), [FakeGroup(journal, "sub")]))
    assert backend.shrunk_with == ([1], 1)  # NCCL_SHRINK_ABORT: the parent's kernels end first
    assert len(kept) == 1 and kept[0].size() == 2
    assert journal.index("shrink") < journal.index("abort default")  # the parent is aborted, after its shrink
    assert "abort sub" in journal  # every other group, as nccl_abort does


@pytest.mark.parametrize("backend_kwargs", [{"fails": RuntimeError("NCCL error: remote process exited\nmore")},
                                            {"shrinks": False}])
def test_a_shrink_that_fails_is_one_line_and_the_usual_abort(backend_kwargs, caplog):
    journal, kept = [], []
    with caplog.at_level(logging.WARNING, logger=ring_shrink.__name__):
        ring_shrink.shrink_then_abort(FakeNccl(journal, **backend_kwargs), (1,), kept.append,
                                      Groups(FakeGroup(journal, "default"), []))
    assert kept == [] and journal[-1] == "abort default"
    assert len(caplog.records) == 1 and "\n" not in caplog.records[0].getMessage()


def test_without_a_registered_default_group_the_backend_itself_is_aborted():
    journal = []
    ring_shrink.shrink_then_abort(FakeNccl(journal), (2,), lambda shrunk: None, Groups(None, []))
    assert journal == ["shrink", "abort"]


def test_the_shrunk_communicator_is_kept_for_its_round_only():
    journal = []
    slot = ShrunkForNextRound()
    first, second = FakeNccl(journal), FakeNccl(journal)
    slot.put(plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), first)
    slot.put(plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), second)  # (never twice in practice): the first is dropped
    assert journal == ["abort"]
    assert slot.take(plan(5, ("m.w0", "m.w2"), lost=("m.w1",))) is second
    assert slot.take(plan(5, ("m.w0", "m.w2"), lost=("m.w1",))) is None  # taken once
    slot.put(plan(5, ("m.w0", "m.w2"), lost=("m.w1",)), first)
    assert slot.take(plan(6, ("m.w0",), lost=("m.w2",))) is None  # superseded before it formed: aborted
    assert journal == ["abort", "abort"]


# -- the control thread's abort: RingCell ---------------------------------------------------------
def ring_on(backend, cap=BOTH, previous=plan(4)):
    handle = RingHandle(frozenset(), other_backend=backend, deadline_s=10, on_overrun=pytest.fail)
    return SimpleNamespace(plan=previous, capability=cap, handle=handle)


@pytest.fixture
def supported(monkeypatch):
    monkeypatch.setattr(ring_shrink, "support_here", lambda environ=None: SUPPORTED)


def test_the_plan_that_names_a_loss_shrinks_the_rings_communicator_for_the_next_round(supported):
    journal, cell = [], RingCell()
    backend = FakeNccl(journal)
    ring = ring_on(backend)
    cell.hold_formed(ring, None, JobStatus())
    successor = plan(5, ("m.w0", "m.w2"), lost=("m.w1",))
    cell.on_control(successor, JobStatus())
    assert ring.handle.aborted and ring.handle.wait_aborted()
    assert backend.shrunk_with == ([1], 1) and journal == ["shrink", "abort"]
    shrunk = cell.shrunk.take(successor)
    assert shrunk is not None and shrunk.size() == 2


@pytest.mark.parametrize("case", ["nccl reported an error", "a reset round", "gloo", "job failed", "still forming"])
def test_otherwise_the_ring_is_aborted_as_today(case, supported, monkeypatch):
    journal, cell = [], RingCell()
    backend = FakeNccl(journal, error="REMOTE_ERROR" if case == "nccl reported an error" else "SUCCESS")
    ring = ring_on(backend, cap=capability("gloo") if case == "gloo" else BOTH)
    newer = plan(5, W, lost=()) if case == "a reset round" else plan(5, ("m.w0", "m.w2"), lost=("m.w1",))
    if case == "gloo":  # no torch or NCCL question asked at all
        monkeypatch.setattr(ring_shrink, "support_here", lambda environ=None: pytest.fail("asked"))
    if case == "a reset round":
        newer = RoundPlan(5, newer.slots, newer.hosts, newer.store_addr, 0.0, recovers=True)
    status = JobStatus(state="failed", reason="x") if case == "job failed" else JobStatus()
    if case == "still forming":  # an init under way: no communicator to shrink yet
        cell.hold_forming(Forming(ring.plan, ring.handle), None, JobStatus())
    else:
        cell.hold_formed(ring, None, JobStatus())
    cell.on_control(newer, status)
    assert ring.handle.aborted and ring.handle.wait_aborted()
    assert journal == ["abort"]  # the stand-in is not torch's NCCL class: abort_every_group aborts it alone
    assert cell.shrunk.take(newer) is None


# -- at the next round's form: the group on it ------------------------------------------------------
@pytest.fixture
def clean_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class Fresh:
    """Today's init (``init_fresh``), recorded: the store namespace it was given."""

    def __init__(self):
        self.stores = []

    def __call__(self, group_store):
        group_store.set("probe", "1")  # where its keys land tells its namespace
        self.stores.append(group_store)


def test_a_round_forms_on_the_shrunk_communicator_when_every_worker_holds_one(clean_world):
    # World of one, on torch's real registry: a gloo backend stands in for the shrunk NCCL part.
    store = dist.HashStore()
    stand_in = dist.ProcessGroupGloo(dist.PrefixStore("stand-in/", store), 0, 1, TIMEOUT)
    before = ring_abort.socket_snapshot()
    fresh = Fresh()
    formed = ring_shrink.init_group(stand_in, fresh, store=store, rank=0, world_size=1, timeout=TIMEOUT,
                                    device=torch.device("cuda", 0), backend=CPU_AND_CUDA, round_number=5)
    assert formed and fresh.stores == []
    group = dist.group.WORLD
    assert dist.get_backend() == CPU_AND_CUDA  # what prepare_ring and new_group read
    assert str(dist.get_backend_config(group)) == CPU_AND_CUDA
    assert group._get_backend(torch.device("cuda")) is stand_in
    assert group.bound_device_id == torch.device("cuda", 0)
    gathered = [None]
    dist.all_gather_object(gathered, {"rank": 0})  # the host part is a real gloo group
    assert gathered == [{"rank": 0}]
    handle = ring_abort.prepare_ring(before=before)
    assert handle.backend_abort  # the round's abort reaches the shrunk communicator
    handle.forget()


def test_every_worker_says_whether_it_holds_one():
    store = dist.HashStore()
    store.set(f"{round_keys.SHRUNK}1", "1")
    assert ring_shrink.every_worker_holds_one(store, 0, 2, True)
    store.set(f"{round_keys.SHRUNK}1", "0")
    assert not ring_shrink.every_worker_holds_one(store, 0, 2, True)
    assert store.get(f"{round_keys.SHRUNK}0") == b"1"


@pytest.mark.parametrize("case", ["a peer holds none", "this one holds none", "this one does not fit"])
def test_unless_every_worker_holds_one_that_fits_all_build_a_new_group(case):
    journal, store = [], dist.HashStore()
    store.set(f"{round_keys.SHRUNK}1", "0" if case == "a peer holds none" else "1")
    shrunk = None if case == "this one holds none" else FakeNccl(journal, rank=0, size=3 if "fit" in case else 2)
    fresh = Fresh()
    formed = ring_shrink.init_group(shrunk, fresh, store=store, rank=0, world_size=2, timeout=TIMEOUT,
                                    device=torch.device("cuda", 0), backend=CPU_AND_CUDA, round_number=5)
    assert not formed and len(fresh.stores) == 1
    assert dist.PrefixStore(round_keys.GROUP, store).check(["probe"])  # the usual namespace: nobody built on it yet
    assert store.get(f"{round_keys.SHRUNK}0") == (b"0" if shrunk is None or "fit" in case else b"1")
    assert journal == ([] if shrunk is None else ["abort"])  # an unused shrunk communicator is aborted


def test_a_shrunk_communicator_that_cannot_join_the_group_falls_back_to_a_new_one(clean_world, monkeypatch, caplog):
    journal, store = [], dist.HashStore()
    shrunk = FakeNccl(journal, rank=0, size=1)

    def attach(*args, **kwargs):
        raise AttributeError("'ProcessGroup' object has no attribute '_register_backend'")

    monkeypatch.setattr(ring_shrink, "attach", attach)
    fresh = Fresh()
    with caplog.at_level(logging.WARNING, logger=ring_shrink.__name__):
        formed = ring_shrink.init_group(shrunk, fresh, store=store, rank=0, world_size=1, timeout=TIMEOUT,
                                        device=torch.device("cuda", 0), backend=CPU_AND_CUDA, round_number=5)
    assert not formed and journal == ["abort"]
    assert not dist.is_initialized()  # the half-built group is gone before the new one forms
    assert dist.PrefixStore(round_keys.GROUP_AFTER_SHRINK, store).check(["probe"])  # a namespace of its own
    assert len(caplog.records) == 1 and "_register_backend" in caplog.records[0].getMessage()


def test_a_host_part_that_fails_to_form_fails_the_round_as_an_init_would(monkeypatch):
    journal, store = [], dist.HashStore()

    def init(*args, **kwargs):
        raise dist.DistNetworkError("Connection reset by peer")

    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(dist.DistNetworkError):
        ring_shrink.init_group(FakeNccl(journal, rank=0, size=1), Fresh(), store=store, rank=0, world_size=1,
                               timeout=TIMEOUT, device=torch.device("cuda", 0), backend=CPU_AND_CUDA, round_number=5)
    assert journal == ["abort"]


# -- RingEntry: which way the round's group is made ---------------------------------------------------
class Control:
    plan, status = None, JobStatus()


def entry_with(backend, worker="m.w0"):
    config = WorkerConfig(job_id="j", endpoints="127.0.0.1:1", worker_id=worker, member_id="m", host_id="h",
                          round=1, backend=backend, collective_timeout=30.0)
    return RingEntry(config, Control(), None, None, None, capability(backend), local_rank=0)


@pytest.fixture
def calls(monkeypatch):
    """What the round's group was made with: today's init, or ring_shrink.init_group."""
    made = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: made.append(("init", backend, kwargs)))
    monkeypatch.setattr(ring_shrink, "init_group", lambda shrunk, fresh, **kwargs: made.append(("shrunk", shrunk,
                                                                                                 kwargs)))
    monkeypatch.setattr(nccl_abort, "device_of_this_worker", lambda: torch.device("cuda", 0))
    return made


def test_gloo_forms_as_always_and_asks_nothing_of_nccl(calls, monkeypatch):
    monkeypatch.setattr(ring_shrink, "support_here", lambda environ=None: pytest.fail("asked"))
    new = plan(5, ("m.w0", "m.w2"), lost=("m.w1",))
    entry_with("gloo")._init_group(Arrival(new, dist.HashStore(), ring_abort.socket_snapshot(), 0, 0), 0, plan(4))
    assert [(kind, backend, sorted(kwargs)) for kind, backend, kwargs in calls] == \
        [("init", "gloo", ["rank", "store", "timeout", "world_size"])]


def test_a_round_that_only_lost_workers_forms_on_the_shrunk_communicator(calls, supported):
    entry, new = entry_with(CPU_AND_CUDA), plan(5, ("m.w0", "m.w2"), lost=("m.w1",))
    shrunk = FakeNccl([], size=2)
    entry.cell.shrunk.put(new, shrunk)
    entry._init_group(Arrival(new, dist.HashStore(), ring_abort.socket_snapshot(), 0, 0), 0, plan(4))
    [(kind, given, kwargs)] = calls
    assert (kind, given, kwargs["rank"], kwargs["world_size"], kwargs["backend"]) == \
        ("shrunk", shrunk, 0, 2, CPU_AND_CUDA)


def test_a_round_with_a_newcomer_builds_a_new_group_and_drops_a_shrunk_one(calls, supported):
    journal = []
    entry, new = entry_with(CPU_AND_CUDA), plan(5, ("m.w0", "m.w2", "m.w3"), lost=("m.w1",))
    entry.cell.shrunk.put(new, FakeNccl(journal))
    entry._init_group(Arrival(new, dist.HashStore(), ring_abort.socket_snapshot(), 0, 0), 0, plan(4))
    [(kind, backend, kwargs)] = calls
    assert (kind, backend, kwargs["device_id"]) == ("init", CPU_AND_CUDA, torch.device("cuda", 0))
    assert journal == ["abort"]
