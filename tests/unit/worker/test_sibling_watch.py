"""A dying worker of this host is seen as it starts to exit (life_lock.py), and what its
siblings then do about it (sibling_watch.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from elastic.rendezvous import FAILED, RUNNING, STOPPING, JobStatus, RoundPlan
from elastic.rendezvous.rounds import Slot
from elastic.worker import life_lock
from elastic.worker.sibling_watch import SiblingWatch

pytestmark = pytest.mark.skipif(life_lock._libc() is None, reason="robust mutexes: Linux with glibc")

# The holder loads life_lock.py alone: no torch, no elastic package (a fast start).
_HOLDER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("life_lock", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
assert mod.hold(sys.argv[2])
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _holder(path, lives_s=60.0):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, life_lock.__file__, str(path), str(lives_s)],
                            stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"held"
    return proc


def test_every_watcher_hears_of_a_kill_and_none_while_the_holder_lives(tmp_path):
    path = life_lock.path_for(str(tmp_path), "w1")
    proc = _holder(path)
    try:
        deaths = []
        heard = threading.Semaphore(0)
        for _ in range(3):  # three watchers of one lock, as three siblings are
            assert life_lock.watch(path, lambda: (deaths.append(time.monotonic()), heard.release()))
        assert not heard.acquire(timeout=0.3)  # alive: nobody hears anything
        os.kill(proc.pid, signal.SIGKILL)
        assert all(heard.acquire(timeout=10) for _ in range(3))
    finally:
        proc.kill()
        proc.wait()
    assert len(deaths) == 3


def test_a_clean_exit_is_heard_too_and_there_is_nothing_to_watch_without_a_lock(tmp_path):
    path = life_lock.path_for(str(tmp_path), "w2")
    proc = _holder(path, lives_s=0.2)
    heard = threading.Event()
    assert life_lock.watch(path, heard.set)
    assert heard.wait(10)  # the caller tells a clean end from a crash (its exit record)
    assert proc.wait(10) == 0
    assert not life_lock.watch(life_lock.path_for(str(tmp_path), "nobody"), heard.set)
    # Only the main thread lives as long as the process: another thread never holds one.
    held = []
    thread = threading.Thread(target=lambda: held.append(life_lock.hold(str(tmp_path / "t.life"))))
    thread.start()
    thread.join()
    assert held == [False] and not (tmp_path / "t.life").exists()


def _plan(round_, *workers):
    slots = tuple(Slot(w.split(".")[0], w) for w in workers)
    return RoundPlan(round_, slots, {s.member_id: ("h", "127.0.0.1") for s in slots}, "127.0.0.1:1", 0.0)


class _Control:
    def __init__(self, plan, status=JobStatus(RUNNING)):
        self.plan, self.status, self.requests = plan, status, []

    def request_reset(self, worker_id, round_number, reason, lost=()):
        self.requests.append((worker_id, round_number, lost))


def _watch(tmp_path, ring, control):
    aborted = []
    watch = SiblingWatch("a.w0", "a", str(tmp_path / "a.w0.elastic"), str(tmp_path / "a.w0.error"), control,
                         lambda: ring, lambda: aborted.append(True))
    return watch, aborted


@pytest.mark.parametrize("case, acts", [
    ("crash", True),  # no record, in our ring and in the newest plan
    ("record", False),  # it said how it ended (finished, a user error): its agent decides
    ("left", False),  # the newest plan no longer has it: it left gracefully
    ("not ours", False),  # not in our ring (a joiner whose round we have not entered)
    ("stopping", False),  # the job stops at a commit: everyone exits
    ("over", False),
])
def test_a_sibling_that_dies_without_a_record_aborts_the_ring_and_is_named_lost(tmp_path, case, acts):
    ring = _plan(3, "a.w0", "a.w1", "b.w0")
    newest = _plan(4, "a.w0", "b.w0") if case == "left" else ring
    status = {"stopping": JobStatus(STOPPING, "stop"), "over": JobStatus(FAILED, "x")}.get(case, JobStatus(RUNNING))
    control = _Control(newest, status)
    watch, aborted = _watch(tmp_path, _plan(3, "a.w0", "b.w0") if case == "not ours" else ring, control)
    if case == "record":
        (tmp_path / "a.w1.error").write_text(json.dumps({"finished": True}))
    watch._on_death("a.w1")
    assert bool(aborted) == acts
    assert control.requests == ([("a.w0.sibling", 3, ("a.w1",))] if acts else [])


def test_the_watch_covers_the_other_workers_of_this_host_once(tmp_path):
    control = _Control(_plan(3, "a.w0", "a.w1", "b.w0"))
    watch, aborted = _watch(tmp_path, control.plan, control)
    assert watch.held and (tmp_path / "a.w0.life").exists()
    proc = _holder(life_lock.path_for(str(tmp_path), "a.w1"))
    try:
        watch.arm(control.plan)
        watch.arm(control.plan)  # the next round: the same sibling is not watched twice
        assert watch._watched == {"a.w1"}  # not itself, not another host's
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not control.requests and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    assert control.requests == [("a.w0.sibling", 3, ("a.w1",))] and aborted == [True]
