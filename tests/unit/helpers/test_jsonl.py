"""The test helper that reads events and steps files: strict except for a torn last line."""

import pytest

from tests.fakes.jsonl import read_jsonl


def test_a_torn_last_line_is_being_written_and_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\n{"event": "b"}\n{"event": "c", "ro')
    assert [r["event"] for r in read_jsonl(path)] == ["a", "b"]


def test_a_complete_last_line_without_its_newline_is_read(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\n{"event": "b"}')
    assert [r["event"] for r in read_jsonl(path)] == ["a", "b"]


def test_a_garbled_line_before_the_last_fails_loudly(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\n{"event": "failure_det\n{"event": "c"}\n')
    with pytest.raises(AssertionError, match=r"events.jsonl:2 is not a JSON line"):
        read_jsonl(path)


def test_a_garbled_last_line_with_its_newline_fails_loudly(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\nnot json\n')
    with pytest.raises(AssertionError, match=r":2 is not a JSON line"):
        read_jsonl(path)


def test_no_file_yet_is_no_lines(tmp_path):
    assert read_jsonl(tmp_path / "missing.jsonl") == []
