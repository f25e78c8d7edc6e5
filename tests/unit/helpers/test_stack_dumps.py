"""The test helper that shows what workers were doing when a wait timed out."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fakes.stacks import stacks_on_timeout, worker_stacks
from tests.fakes.waiting import readline_within

# Registers faulthandler as elastic/contract/progress.py does, then waits in a named function.
CHILD = """
import faulthandler, signal, sys, threading
f = open(sys.argv[1], "w")
faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
def waiting_for_a_peer():
    print("ready", flush=True)
    threading.Event().wait(60)
waiting_for_a_peer()
"""


@pytest.fixture
def waiting_child(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "w0.stacks")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert readline_within(child.stdout, 30).strip() == "ready"
        yield child.pid
    finally:
        child.kill()
        child.wait(10)


def test_a_waiting_worker_shows_where_it_waits(waiting_child):
    dump = worker_stacks([waiting_child])
    assert f"worker pid {waiting_child}" in dump
    assert "waiting_for_a_peer" in dump


def test_a_timed_out_wait_carries_the_stacks(waiting_child):
    with pytest.raises(AssertionError, match="timed out(.|\n)*waiting_for_a_peer"):
        with stacks_on_timeout(lambda: [waiting_child]):
            raise AssertionError("timed out after 1s waiting for steps")
