"""SIGUSR1 also writes NCCL's flight recorder beside the stack dump (gpu review gpu-3 N13),
where torch has one; on a CPU build of torch it does nothing and never fails. The agent
waits for that file after the stacks and keeps it beside the worker's log."""

from __future__ import annotations

import json
import os
import time
import types

import pytest
import torch
import torch._C._distributed_c10d as c10d

from elastic.agent.watchdog import HangPolicy, Watchdog, ask_stacks
from elastic.contract import progress
from elastic.contract.progress import (Progress, ProgressBoard, nccl_flight_recorder, nccl_trace_path,
                                       write_nccl_trace)

RECORDERS = ("_dump_nccl_trace_json", "_dump_nccl_trace")


def _json():
    return b'{"entries": []}'


def _pickle():
    return b"\x80\x04pickle"


# What torch._C._distributed_c10d has -> which dump is used (None: no recorder)
@pytest.mark.parametrize("has, used", [
    ({"_dump_nccl_trace_json": _json, "_dump_nccl_trace": _pickle}, _json),  # JSON where torch has it
    ({"_dump_nccl_trace": _pickle}, _pickle),
    ({}, None),  # a CPU build: _dump_fr_trace only, which is not NCCL's
    ({"_dump_nccl_trace_json": "not callable"}, None),
])
def test_which_flight_recorder_dump_is_used(has, used):
    assert nccl_flight_recorder(types.SimpleNamespace(**has)) is used


def test_a_process_without_torch_has_no_recorder(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "torch")
    assert nccl_flight_recorder() is None


def test_the_trace_is_written_whole_and_a_failed_dump_says_why(tmp_path):
    path = str(tmp_path / "w.stacks.nccl-trace")
    assert write_nccl_trace(path, lambda: '{"entries": [1]}') is None
    assert json.loads(open(path).read()) == {"entries": [1]}

    def broken():
        raise RuntimeError("the recorder's lock")

    why = write_nccl_trace(path, broken)
    assert why == "RuntimeError: the recorder's lock"
    assert json.loads(open(path).read()) == {"dump_failed": why}
    assert sorted(os.listdir(tmp_path)) == ["w.stacks.nccl-trace"]  # no temporary left behind


def _progress(tmp_path):
    board = str(tmp_path / "w.progress")
    ProgressBoard.create(board)
    return Progress(board, str(tmp_path / "w.stacks"))


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_without_nccl_the_handler_writes_its_stacks_and_nothing_else(tmp_path, monkeypatch):
    for name in RECORDERS:  # as on a CPU build of torch, whatever this host's build is
        monkeypatch.delattr(c10d, name, raising=False)
    worker = _progress(tmp_path)
    try:
        assert worker.nccl_trace is None
        dumps = ask_stacks({"w": (os.getpid(), str(tmp_path / "w.stacks"), True)}, grace=5.0)
        assert "test_without_nccl_the_handler_writes_its_stacks" in dumps["w"]
        time.sleep(0.6)  # two heartbeats: still nothing beside the stacks
        assert not os.path.exists(nccl_trace_path(str(tmp_path / "w.stacks")))
    finally:
        worker.close()


def test_with_a_recorder_the_signal_writes_it_beside_the_stacks_and_the_agent_waits_for_it(tmp_path, monkeypatch):
    calls = []

    def dump():  # slower than the agent's look at the stacks: it must wait for this
        calls.append(time.monotonic())
        time.sleep(0.3)
        return b'{"pg_config": {}, "entries": [{"state": "started"}]}'

    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", dump, raising=False)
    stacks = str(tmp_path / "w.stacks")
    trace = nccl_trace_path(stacks)
    worker = _progress(tmp_path)
    try:
        assert worker.nccl_trace is not None and os.path.getsize(trace) == 0  # announced
        dumps = ask_stacks({"w": (os.getpid(), stacks, True)}, grace=5.0)
        assert "test_with_a_recorder" in dumps["w"]
        # ask_stacks returned only once the trace was there: the SIGKILL that follows keeps it.
        assert len(calls) == 1 and json.loads(open(trace).read())["entries"] == [{"state": "started"}]
        ask_stacks({"w": (os.getpid(), stacks, True)}, grace=5.0)  # each ask, a fresh dump
        assert len(calls) == 2
    finally:
        worker.close()


def test_a_stuck_dump_never_stops_the_heartbeat(tmp_path, monkeypatch):
    release = __import__("threading").Event()
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda: release.wait(10) and b"{}", raising=False)
    worker = _progress(tmp_path)
    view = ProgressBoard(str(tmp_path / "w.progress"), writable=False)
    try:
        ask_stacks({"w": (os.getpid(), str(tmp_path / "w.stacks"), True)}, grace=0.3)
        beats = view.read().beats
        _wait_for(lambda: view.read().beats > beats + 2)
    finally:
        release.set()
        worker.nccl_trace.wait(5)
        worker.close()
        view.close()


def test_the_agent_keeps_a_hung_workers_trace_beside_its_log(tmp_path):
    scratch, logs = tmp_path / "scratch", tmp_path / "logs"
    scratch.mkdir()
    logs.mkdir()
    dog = Watchdog(HangPolicy(), str(scratch), events=types.SimpleNamespace(emit=lambda *a, **k: None),
                   log_dir=str(logs))
    trace = nccl_trace_path(str(scratch / "m.w0.stacks"))
    assert dog._keep_nccl_trace("m.w0") is None  # none announced
    open(trace, "wb").close()
    assert dog._keep_nccl_trace("m.w0") is None  # announced, never written
    open(trace, "wb").write(b'{"entries": []}')
    kept = dog._keep_nccl_trace("m.w0")
    assert kept == str(logs / "worker-m.w0.nccl-trace") and open(kept).read() == '{"entries": []}'
    assert not os.path.exists(trace)


def test_a_torch_without_nccl_has_no_recorder():
    if torch.distributed.is_nccl_available():
        pytest.skip("this torch has NCCL")
    assert all(not hasattr(c10d, name) for name in RECORDERS)
    assert progress.nccl_flight_recorder() is None
