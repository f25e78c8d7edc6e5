"""The recovery benchmark's phases: notice (the kill until a survivor's failure) from reform_done."""

import json

from benchmarks.recovery import reform_phases


def _write(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_phases_are_the_slowest_survivors_of_the_first_round_after_the_kill(tmp_path):
    kill = 1000.0
    events = tmp_path / "events.jsonl"
    _write(events, [
        {"event": "reform_done", "time": 999.0, "round": 1, "total_s": 0.1},  # before the kill: ignored
        # noticed 0.20 s and 0.25 s after the kill; 0.05 s and 0.10 s to re-form
        {"event": "reform_done", "time": 1000.25, "round": 2, "total_s": 0.05, "detect_s": 0.01, "pg_init_s": 0.02},
        {"event": "reform_done", "time": 1000.35, "round": 2, "total_s": 0.10, "detect_s": 0.03, "pg_init_s": 0.01},
        {"event": "reform_done", "time": 1005.0, "round": 3, "total_s": 2.0, "detect_s": 1.0},  # a later round
    ])
    phases = reform_phases(events, kill)
    assert round(phases["notice_s"], 6) == 0.25
    assert phases["detect_s"] == 0.03 and phases["pg_init_s"] == 0.02 and phases["total_s"] == 0.10
    assert phases["pg_store_s"] == 0.0  # a tree whose reform_done has no such field


def test_no_reform_after_the_kill_gives_none(tmp_path):
    events = tmp_path / "events.jsonl"
    _write(events, [{"event": "reform_done", "time": 10.0, "round": 2, "total_s": 0.1}])
    assert reform_phases(events, 20.0) is None
    assert reform_phases(tmp_path / "missing.jsonl", 20.0) is None
