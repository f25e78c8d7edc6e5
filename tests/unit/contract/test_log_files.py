"""Log rotation: size bounds, the rotated files read back oldest first, the agent's tail across a rotation."""

from __future__ import annotations

import json

import pytest

from elastic.agent.event_tail import EventTail
from elastic.cli.timeline import find_events_files, read_events
from elastic.contract.log_files import byte_size, log_paths, rotate


@pytest.mark.parametrize("text, value", [
    ("0", 0), ("4096", 4096), ("64KiB", 65536), ("64k", 65536), ("100M", 100 * 2 ** 20), ("1g", 2 ** 30),
    ("2 MB", 2 * 2 ** 20),
])
def test_byte_size(text, value):
    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["", "-1", "10", "1.5M", "lots", "5T"])
def test_byte_size_refuses(text):
    with pytest.raises(ValueError):
        byte_size(text)


def test_rotation_keeps_the_newest_files_and_readers_see_them_oldest_first(tmp_path):
    path = str(tmp_path / "events.jsonl")
    for i in range(4):
        with open(path, "a") as f:
            f.write(json.dumps({"time": i, "event": f"e{i}"}) + "\n")
        rotate(path, keep=2)
    with open(path, "a") as f:
        f.write(json.dumps({"time": 9, "event": "e9"}) + "\n")
    assert log_paths(path) == [path + ".2", path + ".1", path]
    assert find_events_files(str(tmp_path)) == [path + ".2", path + ".1", path]
    assert [e["event"] for e in read_events(find_events_files(str(tmp_path)))] == ["e2", "e3", "e9"]


def _append(path, *events):
    with open(path, "a") as f:
        for e in events:
            f.write(json.dumps({"event": e}) + "\n")


def test_the_tail_rotates_the_events_file_and_misses_no_line(tmp_path):
    path = str(tmp_path / "events.jsonl")
    tail = EventTail(path, from_start=True, max_bytes=4096)
    _append(path, *[f"a{i}" for i in range(400)])  # over 4 KiB
    assert len(tail.read_new()) == 400
    assert log_paths(path) == [path + ".1"]  # rotated, the new file not yet created
    # a worker that opened the path before the rename wrote into the rotated file
    _append(path + ".1", "late")
    _append(path, "b0")
    assert [e["event"] for e in tail.read_new()] == ["late", "b0"]
    _append(path, "b1")
    assert [e["event"] for e in tail.read_new()] == ["b1"]
