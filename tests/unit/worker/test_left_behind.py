"""The left-behind check of commits (elastic/worker/left_behind.py), against fake clocks and a fake etcd."""

from __future__ import annotations

import pytest

from elastic.worker.left_behind import TICK_S, LeftBehindCheck
from elastic.contract.errors import LeftBehind
from elastic.contract.faults import RING
from elastic.worker.failures import classify
from elastic.rendezvous import JobKeys, RendezvousConnectionError
from elastic.rendezvous.etcd import KeyValue
from elastic.rendezvous.rounds import RoundPlan, Slot
from tests.fakes.jobs import wait_until

KEYS = JobKeys("j")
ME = "m.w1"
TTL = 10.0


def plan(round_, workers, lost=()):
    return RoundPlan(round_, tuple(Slot("m", w) for w in workers), {"m": ("h", "127.0.0.1")}, "127.0.0.1:1", 0.0,
                     lost=tuple(lost))


class FakeEtcd:
    """Holds the plans of past rounds (rounds/<n>) and the newest (control/plan)."""

    def __init__(self, *plans, down=False):
        self.plans, self.down, self.reads = list(plans), down, 0

    def _kv(self, key, p):
        return KeyValue(key, p.to_json(), 1, 1, 1, 0)

    def get(self, key, *, retry_deadline=None):
        self.reads += 1
        if self.down:
            raise RendezvousConnectionError("cannot reach etcd")
        assert key == KEYS.plan
        return self._kv(key, self.plans[-1]) if self.plans else None

    def get_prefix(self, prefix, *, retry_deadline=None):
        self.reads += 1
        assert prefix == KEYS.prefix + "rounds/"
        return [self._kv(KEYS.round(p.round), p) for p in self.plans], 1


class Clocks:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def left_behind(etcd):
    clock = Clocks()
    return LeftBehindCheck(etcd, KEYS, ME, TTL, ticking=False, clock=clock, wall=clock), clock


def run_for(f, clock, seconds):
    """The process runs: its pause clock ticks (every 0.25 s)."""
    end = clock.t + seconds
    while clock.t < end:
        clock.t += 0.25
        f.tick()


def test_a_worker_declared_lost_completes_no_commit_and_re_forms():
    """Seen in the cached plan (the control watch): no etcd read."""
    etcd = FakeEtcd()
    f, _ = left_behind(etcd)
    with pytest.raises(LeftBehind, match="round 2 declared it lost") as raised:
        f.check(1, plan(2, ["m.w0"], lost=[ME]))
    assert classify(raised.value).kind == RING  # a failure of its ring for the recovery path
    f.check(1, plan(2, ["m.w0", "m.w2"], lost=["m.w3"]))  # somebody else was lost
    f.check(1, plan(1, ["m.w0", ME]))
    f.check(2, plan(2, ["m.w0"], lost=[ME]))  # that round is ours: we re-joined it
    assert etcd.reads == 0


@pytest.mark.parametrize("ticked_first", [False, True], ids=["commit-first", "pause-clock-first"])
def test_after_a_pause_the_plans_since_our_round_are_read_from_etcd(ticked_first):
    """A paused host resumes: the main thread commits before the watch thread has caught up.
    The job went through round 2 (lost us) and round 3 (let us back in) meanwhile. Whichever
    of the main thread and the pause clock's thread runs first after the resume."""
    etcd = FakeEtcd(plan(1, ["m.w0", ME]), plan(2, ["m.w0"], lost=[ME]), plan(3, ["m.w0", ME]))
    f, clock = left_behind(etcd)
    run_for(f, clock, 60)  # an honest 60 s step: the process ran all along, nothing to read
    f.check(1, plan(1, ["m.w0", ME]))
    assert etcd.reads == 0
    clock.t += TTL  # stopped: no tick
    if ticked_first:
        f.tick()
    with pytest.raises(LeftBehind, match="round 2 declared it lost"):
        f.check(1, plan(1, ["m.w0", ME]))  # the stale view says round 1 is current
    assert etcd.reads == 2


def test_after_a_pause_a_current_round_or_an_unreachable_etcd_lets_the_commit_go():
    current = FakeEtcd(plan(1, ["m.w0", ME]))
    f, clock = left_behind(current)
    clock.t += TTL
    f.check(1, plan(1, ["m.w0", ME]))
    assert current.reads == 1  # the newest plan is ours: nothing more to read
    down = FakeEtcd(down=True)
    f, clock = left_behind(down)
    clock.t += TTL
    f.check(1, plan(1, ["m.w0", ME]))  # an etcd outage never stops training
    assert down.reads == 1


def test_a_pause_shorter_than_a_quarter_of_the_ttl_or_during_a_re_formation_is_not_read():
    etcd = FakeEtcd(plan(1, ["m.w0", ME]), plan(2, ["m.w0"], lost=[ME]))
    f, clock = left_behind(etcd)
    clock.t += TTL / 4 - 0.1
    f.check(1, plan(1, ["m.w0", ME]))
    clock.t += TTL
    f.tick()
    f.reset()  # the ring was entered since: in step with it
    f.check(1, plan(1, ["m.w0", ME]))
    assert etcd.reads == 0


def test_a_wall_clock_jump_counts_as_a_pause():
    """A paused VM's monotonic clock may not advance while it is paused; its wall clock does."""
    etcd = FakeEtcd(plan(1, ["m.w0", ME]), plan(2, ["m.w0"], lost=[ME]))
    mono, wall = Clocks(), Clocks()
    f = LeftBehindCheck(etcd, KEYS, ME, TTL, ticking=False, clock=mono, wall=wall)
    wall.t += 60
    with pytest.raises(LeftBehind):
        f.check(1, plan(1, ["m.w0", ME]))


def test_the_pause_clock_ticks_in_a_thread_of_its_own():
    f = LeftBehindCheck(FakeEtcd(plan(1, ["m.w0", ME])), KEYS, ME, TTL)
    try:
        with f._lock:
            created = f._last_tick[0]

        def ticked_twice():  # nothing else calls tick() here: the check's own thread did
            with f._lock:
                return f._last_tick[0] - created >= 2 * TICK_S - 0.01

        wait_until(ticked_twice, 10, "two ticks of the pause clock")
    finally:
        f.close()
