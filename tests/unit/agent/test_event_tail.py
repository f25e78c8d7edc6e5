"""EventTail: the agent reads its workers' events, line by line, as they are appended."""

from __future__ import annotations

import json

from elastic.agent.event_tail import EventTail


def _append(path, data: bytes):
    with open(path, "ab") as f:
        f.write(data)


def test_only_new_complete_lines_are_read_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    _append(path, b'{"event": "old"}\n')
    tail = EventTail(str(path))  # an earlier run's events are not read
    assert tail.read_new() == []
    _append(path, json.dumps({"event": "a"}).encode() + b"\n" + b'{"event": "b", "x"')
    assert [e["event"] for e in tail.read_new()] == ["a"]
    _append(path, b': 1}\n{"torn\n{"event": "c"}\n')
    assert [e["event"] for e in tail.read_new()] == ["b", "c"]
    assert tail.read_new() == []


def test_a_missing_file_is_no_events_yet(tmp_path):
    tail = EventTail(str(tmp_path / "none.jsonl"), from_start=True)
    assert tail.read_new() == []
    _append(tmp_path / "none.jsonl", b'{"event": "first"}\n')
    assert [e["event"] for e in tail.read_new()] == ["first"]
