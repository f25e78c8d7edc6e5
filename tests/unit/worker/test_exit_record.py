"""When a worker's exit record says it finished: a return of @elastic.run, or the normal end
of a script that never entered it; never an exit 0 some other way."""

from __future__ import annotations

import pytest

from elastic.contract.faults import PROCESS, ExitRecord, Fault, read_record
from elastic.worker import exit_record


@pytest.fixture
def path(tmp_path, monkeypatch):
    monkeypatch.setattr(exit_record, "_trains_under_run", False)
    monkeypatch.setattr(exit_record, "_written", False)
    target = str(tmp_path / "w0.error")
    monkeypatch.setattr(exit_record, "_path", target)
    return target


def test_a_script_without_elastic_run_finishes_at_its_normal_end(path):
    exit_record.at_exit()
    assert read_record(path) == ExitRecord(finished=True)


def test_under_elastic_run_only_its_return_is_a_finish(path):
    exit_record.training_started()
    exit_record.at_exit()  # sys.exit(0) mid-training, a stop at a commit: no finish
    assert read_record(path) is None
    exit_record.finished()
    assert read_record(path) == ExitRecord(finished=True)


def test_an_uncaught_error_is_not_overwritten_by_the_normal_end(path):
    exit_record.failed(Fault(PROCESS, "OutOfMemoryError: x"))
    exit_record.at_exit()
    assert read_record(path) == ExitRecord(fault=Fault(PROCESS, "OutOfMemoryError: x"))


def test_without_an_agent_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(exit_record, "_path", None)
    monkeypatch.setattr(exit_record, "_written", False)
    exit_record.finished()
    assert list(tmp_path.iterdir()) == []
