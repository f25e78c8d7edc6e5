"""elastic-run's exit status from the job's final status, and the status's cause in etcd."""

from __future__ import annotations

import json

import pytest

from elastic.agent.outcome import exit_status
from elastic.contract import exit_codes
from elastic.rendezvous import FAILED, RUNNING, STOPPING, SUCCEEDED, JobStatus
from elastic.rendezvous.control import CAUSE_USER_CODE


@pytest.mark.parametrize("status, code", [
    (JobStatus(SUCCEEDED, "worker a.w0 finished"), exit_codes.SUCCEEDED),
    (JobStatus(STOPPING, "2 leaving would leave 1 < min_np=2"), exit_codes.SUCCEEDED),
    (JobStatus(FAILED, "worker a.w1 failed: ValueError: bad batch", cause=CAUSE_USER_CODE), exit_codes.USER_ERROR),
    (JobStatus(FAILED, "worker a.w1 died (signal 9); --max-restarts 0 used up"), exit_codes.JOB_FAILED),
    (JobStatus(FAILED, "only 1 of min_np=2 workers present after waiting 5s"), exit_codes.JOB_FAILED),
    (JobStatus(FAILED, "worker a.w1 failed: ResetLimitExceeded: ring re-formed 1 times"), exit_codes.JOB_FAILED),
    # A cause on anything but a failure changes nothing.
    (JobStatus(SUCCEEDED, "done", cause=CAUSE_USER_CODE), exit_codes.SUCCEEDED),
    (JobStatus(RUNNING), exit_codes.JOB_FAILED),  # an agent that ends while the job runs did not finish it
])
def test_exit_status_of_each_ending(status, code):
    assert exit_status(status) == code


def test_the_statuses_are_distinct_and_fit_a_shell():
    codes = [exit_codes.SUCCEEDED, exit_codes.JOB_FAILED, exit_codes.USAGE_ERROR, exit_codes.USER_ERROR]
    assert codes == [0, 1, 2, 3]
    # Never one a shell or a container runtime gives a signal death (128 + N).
    assert exit_codes.WORKER_BROKEN < 128 and exit_codes.WORKER_BROKEN not in codes


def test_the_cli_exits_2_on_bad_options_from_the_contract():
    from elastic.cli.options import USAGE_ERROR

    assert USAGE_ERROR == exit_codes.USAGE_ERROR == 2


@pytest.mark.parametrize("text, value", [("0", 0), ("143", 143), ("255", 255), ("256", None), ("-1", None)])
def test_leave_exit_code_is_a_status_a_parent_can_read(text, value):
    from elastic.cli.options import exit_code

    if value is None:
        with pytest.raises(ValueError):
            exit_code(text)
    else:
        assert exit_code(text) == value


def test_the_cause_round_trips_and_is_absent_unless_said():
    failed = JobStatus(FAILED, "worker a.w1 failed: ValueError: x", since=5.0, cause=CAUSE_USER_CODE)
    assert JobStatus.from_json(failed.to_json()) == failed
    assert "cause" not in json.loads(JobStatus(FAILED, "etcd lost", since=5.0).to_json())


def test_a_status_written_without_a_cause_reads_as_not_a_user_error():
    # Written by an agent that predates the field.
    old = json.dumps({"state": "failed", "reason": "worker a.w1 failed: ValueError: x", "since": 1.0}).encode()
    status = JobStatus.from_json(old)
    assert status.cause == "" and exit_status(status) == exit_codes.JOB_FAILED
