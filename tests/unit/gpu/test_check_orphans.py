"""A GPU check's processes die with it (gpu review gpu-3 N11): the children it started in
sessions of their own (agents, NCCL children) survive the kill of its process group, so
the runner kills whatever still carries the check's tag. On the CPU, with a fake check."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from tests.gpu import check
from tests.fakes.jobs import wait_until
from tests.gpu.check_base import TAG, sweep, tagged
from tests.unit.gpu.fake_orphan_checks import ORPHANS, PID_FILE


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan killed is reaped by whoever adopted it, later)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def test_sweep_kills_a_tagged_process_in_a_session_of_its_own():
    tag = f"test-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             env={**os.environ, TAG: tag}, start_new_session=True)
    try:
        # Popen returns once the child's exec closed its descriptors, a moment before the
        # kernel sets where its environment lies: until then /proc says it has none.
        wait_until(lambda: tagged(tag) or child.poll() is not None, 10, "the child to show its tag")
        assert sweep(f"other-{tag}") == 0 and child.poll() is None  # another check's tag: left alone
        assert sweep(tag) == 1
        assert child.wait(10) == -9
    finally:
        child.kill()
        child.wait(10)


def test_a_timed_out_checks_orphans_are_killed_with_it(tmp_path):
    registry = "tests.unit.gpu.fake_orphan_checks:ORPHANS"
    facts = tmp_path / "facts.json"
    facts.write_text("{}")
    run = check.Running(ORPHANS[0], registry, tmp_path, facts)
    pid_file = tmp_path / ORPHANS[0].name / PID_FILE
    orphan = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and not run.poll(), "the fake check never started its child"
            time.sleep(0.05)
        orphan = int(pid_file.read_text())
        run.started -= 10_000  # past its budget now: the next poll kills it
        assert run.poll() and run.timed_out
        assert _alive(orphan)  # its own session: the process-group kill missed it
        entry = run.entry()
        assert entry["status"] == "FAIL" and "timed out" in entry["detail"]
        assert entry["figures"]["processes_killed_after"] >= 1
        deadline = time.monotonic() + 10
        while _alive(orphan):
            assert time.monotonic() < deadline, "the check's orphan outlived it"
            time.sleep(0.05)
    finally:
        if orphan is not None:
            _kill(orphan)
        if run.proc.poll() is None:
            _kill(run.proc.pid)
            run.proc.wait(10)
