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


def test_lines_appended_after_a_read_are_read_next_time_and_a_torn_line_once_whole(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"step": 1}\n{"st')
    assert read_jsonl(path) == [{"step": 1}]
    with open(path, "a") as f:
        f.write('ep": 2}\n{"step": 3}\n')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}, {"step": 3}]
    got = read_jsonl(path)
    got[0]["step"] = 99  # a caller's change is its own
    assert read_jsonl(path)[0] == {"step": 1}


def test_a_file_rewritten_or_rotated_is_read_again_from_its_start(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\n{"event": "b"}\n')
    assert [r["event"] for r in read_jsonl(path)] == ["a", "b"]
    with open(path, "r+") as f:  # rewritten in place, same file, longer
        f.write('{"event": "x"}\n{"event": "y"}\n{"event": "z"}\n')
    assert [r["event"] for r in read_jsonl(path)] == ["x", "y", "z"]
    path.rename(tmp_path / "events.jsonl.1")  # rotated: a new file takes the name
    path.write_text('{"event": "n"}\n')
    assert [r["event"] for r in read_jsonl(path)] == ["x", "y", "z", "n"]
    path.write_text('{"event": "m"}\n')  # truncated and written again
    assert [r["event"] for r in read_jsonl(path)] == ["x", "y", "z", "m"]


def test_a_garbled_line_appended_after_a_read_fails_loudly_with_its_number(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\n')
    read_jsonl(path)
    with open(path, "a") as f:
        f.write('{"event": "failure_det\n{"event": "c"}\n')
    with pytest.raises(AssertionError, match=r"events.jsonl:2 is not a JSON line"):
        read_jsonl(path)
