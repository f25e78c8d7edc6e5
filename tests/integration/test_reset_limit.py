"""--max-resets used up: the job fails once, with one line that says so (not a re-form loop)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.fakes.jobs import Job

pytestmark = pytest.mark.timeout(300)


def test_a_failure_beyond_max_resets_fails_the_job_with_one_line(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    job = Job(tmp_path, Job.train_args(out, logs, ["--np", "3", "--min-np", "2", "--max-resets", "0"],
                                       ["--steps", "100000", "--step-delay", "0.02"]))
    job.wait_for_step(5)
    os.kill(job.worker_pid(2), signal.SIGKILL)
    assert job.wait(120) == 1, job.text()[-3000:]
    text = job.text()
    failed = [line for line in text.splitlines() if line.startswith("elastic-run: job ") and "failed" in line]
    assert len(failed) == 1, text[-3000:]
    assert "--max-resets 0" in failed[0] and "ResetLimitExceeded" in failed[0], failed[0]
    assert not [e for e in job.events() if e["event"] == "reform_done"]
