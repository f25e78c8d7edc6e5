"""The worker's exit record: written whole, read back as written, anything else is no record."""

from __future__ import annotations

import pytest

from elastic.contract.faults import (
    BUDGET,
    NETWORK,
    PROCESS,
    RING,
    STORAGE,
    USER,
    ExitRecord,
    Fault,
    read_record,
    write_record,
)


@pytest.mark.parametrize("record", [
    ExitRecord(finished=True),
    ExitRecord(fault=Fault(USER, "ValueError: bad batch")),
    ExitRecord(fault=Fault(PROCESS, "OutOfMemoryError: CUDA out of memory")),
    ExitRecord(fault=Fault(NETWORK, "round 2: workers could not connect to each other")),
    ExitRecord(fault=Fault(BUDGET, "ResetLimitExceeded: ring re-formed 3 times")),
    ExitRecord(fault=Fault(STORAGE, "CheckpointsUnreadable: /ckpt/step-40: EIO")),
    ExitRecord(fault=Fault(RING, 'DistNetworkError: "quoted", \\ and unicode \u00e9')),
])
def test_a_record_round_trips(tmp_path, record):
    path = str(tmp_path / "w0.error")
    write_record(path, record)
    assert read_record(path) == record
    assert not (tmp_path / "w0.error.partial").exists()


@pytest.mark.parametrize("text", [
    "",
    "ValueError: bad batch",  # the old one-line report
    "peers unreachable: round 2",
    "[1, 2]",
    '{"finished": "yes"}',
    '{"finished": false, "kind": "gremlin", "reason": "x"}',
    '{"finished": false, "kind": "user", "reason": 5}',
    '{"finished": true' + " " * 70000 + "}",  # larger than any record a worker writes
])
def test_anything_else_is_no_record(tmp_path, text):
    path = tmp_path / "w0.error"
    path.write_text(text)
    assert read_record(str(path)) is None


def test_no_file_is_no_record(tmp_path):
    assert read_record(str(tmp_path / "absent")) is None


def test_a_fault_of_an_unknown_kind_cannot_be_made():
    with pytest.raises(ValueError):
        Fault("gremlin", "x")


def test_only_a_broken_ring_and_unreachable_peers_re_form():
    assert [k for k in (RING, NETWORK, PROCESS, USER, BUDGET, STORAGE) if Fault(k, "x").reforms] == [RING, NETWORK]
