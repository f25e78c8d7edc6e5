"""--max-resets used up: the job fails once, with one line that says so (not a re-form loop).
The budget is per --reset-window: failures further apart than the window never use it up."""

from __future__ import annotations

import os
import signal

import pytest

from tests.fakes.jobs import Job, wait_until
from tests.fakes.waiting import holds

pytestmark = pytest.mark.timeout(300)


def test_a_failure_beyond_max_resets_fails_the_job_with_one_line(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    # Two workers are enough: the survivor alone is a ring (--min-np 1) it may not re-form.
    job = Job(tmp_path, Job.train_args(out, logs, ["--np", "2", "--min-np", "1", "--max-resets", "0"],
                                       ["--steps", "100000", "--step-delay", "0.02"]))
    job.wait_for_step(5)
    os.kill(job.worker_pid(1), signal.SIGKILL)
    assert job.wait(120) == 1, job.text()[-3000:]
    text = job.text()
    failed = [line for line in text.splitlines() if line.startswith("elastic-run: job ") and "failed" in line]
    assert len(failed) == 1, text[-3000:]
    assert "--max-resets 0" in failed[0] and "ResetLimitExceeded" in failed[0], failed[0]
    assert not [e for e in job.events() if e["event"] == "reform_done"]


def _kill_rank_1_and_wait_for_world(job: Job, world: int) -> None:
    """SIGKILL the worker holding rank 1 now; return once the survivors have re-formed
    (spending their reset budget) and completed a step in a ring of ``world``."""
    os.kill(job.worker_pid(1), signal.SIGKILL)
    wait_until(lambda: any(s["world"] == world for s in job.steps()), 120, f"a step in a ring of {world}")


def _failed_lines(job: Job) -> list[str]:
    return [line for line in job.text().splitlines() if line.startswith("elastic-run: job ") and "failed" in line]


def test_kills_further_apart_than_the_reset_window_never_use_up_max_resets(tmp_path):
    window = 3.0
    stop = tmp_path / "stop"
    job = Job(tmp_path, Job.train_args(
        tmp_path / "out", tmp_path / "logs",
        ["--np", "3", "--min-np", "1", "--max-resets", "1", "--reset-window", str(window)],
        ["--steps", "100000", "--step-delay", "0.02", "--stop-file", str(stop)]))
    job.wait_for_step(5)
    _kill_rank_1_and_wait_for_world(job, 2)
    # A deliberate interval, not synchronisation: rank 0 spent its one re-formation
    # before that step; once the window has passed since, it no longer counts.
    assert holds(lambda: job.proc.poll() is None, window + 1.0), job.text()[-3000:]
    _kill_rank_1_and_wait_for_world(job, 1)
    stop.touch()
    assert job.wait(120) == 0, job.text()[-3000:]
    assert not _failed_lines(job), job.text()[-3000:]
    # The survivor re-formed twice (worlds 3 -> 2 -> 1) within its budget of one per window.
    assert {s["world"] for s in job.steps() if s["rank"] == 0} == {3, 2, 1}


def test_two_kills_within_the_reset_window_fail_the_job_with_one_line(tmp_path):
    job = Job(tmp_path, Job.train_args(
        tmp_path / "out", tmp_path / "logs",
        ["--np", "3", "--min-np", "1", "--max-resets", "1", "--reset-window", "600"],
        ["--steps", "100000", "--step-delay", "0.02"]))
    job.wait_for_step(5)
    _kill_rank_1_and_wait_for_world(job, 2)
    os.kill(job.worker_pid(1), signal.SIGKILL)  # the second re-formation within 600 s: one too many
    assert job.wait(120) == 1, job.text()[-3000:]
    failed = _failed_lines(job)
    assert len(failed) == 1, job.text()[-3000:]
    assert "ResetLimitExceeded" in failed[0] and "within 600s (--max-resets 1 per --reset-window)" in failed[0], \
        failed[0]
    assert not [s for s in job.steps() if s["world"] == 1]  # never trained in the third ring
