"""The NCCL checks' verdicts from their children's output, on a CPU: what the first GPU
run will print for the outcomes the review expects (the children's lines and statuses
are canned here; on a GPU they are real)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.gpu import checks_nccl
from tests.gpu.check_base import Child, Context


def ctx(tmp_path: Path) -> Context:
    return Context(workdir=tmp_path, budget_s=60)


def canned(monkeypatch, *children):
    seen = {}

    def run_children(commands, envs, timeout_s, cwd=None):
        seen["envs"], seen["commands"] = envs, commands
        return list(children)

    monkeypatch.setattr(checks_nccl, "run_children", run_children)
    return seen


def alive(rc=0):
    return Child(rc, "formed\nalive\n", "", time.time())


def test_stale_dump_key_passes_when_the_workers_env_survives(tmp_path, monkeypatch):
    seen = canned(monkeypatch, alive(), alive(), Child(-6, "formed\n", "terminate called", time.time()), alive())
    outcome = checks_nccl.stale_dump_key(ctx(tmp_path))
    assert outcome.ok and "control with dump-on-timeout died" in outcome.detail
    assert "once the round entry cleared it" in outcome.detail
    assert outcome.figures["dump_on_timeout_in_workers_env"] == "0"
    seeded, clean, control, cleared = seen["envs"]
    assert seeded["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and control["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert cleared["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # dumps on: only the clear can save it
    assert seeded["TORCH_NCCL_USE_COMM_NONBLOCKING"] == "1" and seeded["CUDA_VISIBLE_DEVICES"]
    assert [cmd[-1] == "clear" for cmd in seen["commands"]] == [False, False, False, True]


def test_stale_dump_key_fails_when_the_workers_env_is_killed(tmp_path, monkeypatch):
    canned(monkeypatch, Child(-6, "formed\n", "", time.time()), alive(), Child(-6, "formed\n", "", time.time()),
           alive())
    outcome = checks_nccl.stale_dump_key(ctx(tmp_path))
    assert not outcome.ok and "killed by a stale exception_dump key (rc -6)" in outcome.detail


def test_stale_dump_key_fails_when_clearing_the_key_does_not_save_a_group_with_dumps_on(tmp_path, monkeypatch):
    canned(monkeypatch, alive(), alive(), Child(-6, "formed\n", "", time.time()), Child(-6, "formed\n", "", 0.0))
    outcome = checks_nccl.stale_dump_key(ctx(tmp_path))
    assert not outcome.ok and "clearing the key at round entry did not save" in outcome.detail


@pytest.mark.parametrize("lag, ok", [(0.8, True), (15.2, False)])
def test_exit_join_measures_the_time_from_the_scripts_end_to_the_exit(tmp_path, monkeypatch, lag, ok):
    t = time.time()
    canned(monkeypatch, Child(0, f"alive {t}\n", "", t + lag), Child(0, f"alive {t}\n", "", t + 15.1))
    outcome = checks_nccl.exit_join(ctx(tmp_path))
    assert outcome.ok is ok and outcome.figures["workers_exit_after_s"] == pytest.approx(lag, abs=0.01)
    assert outcome.figures["control_exit_after_s"] == pytest.approx(15.1, abs=0.01)


def test_exit_join_of_a_child_killed_at_the_bound_fails(tmp_path, monkeypatch):
    canned(monkeypatch, Child(None, "", "", time.time()), alive())
    assert not checks_nccl.exit_join(ctx(tmp_path)).ok


def marks(*pairs, extra=""):
    return "".join(f"at {what} {at}\n" for what, at in pairs) + extra


@pytest.mark.parametrize("busy, ok, says", [
    # The review's expectation with the fix: the waiting collective raises at the
    # non-blocking timeout (30 s), then the abort goes through, before its deadline.
    (marks(("init_returned", 3.0), ("abort_called", 5.0), ("all_reduce_raised", 33.0), ("abort_returned", 33.5),
           extra="error DistBackendError NCCL communicator timed out\n"), True, "behind a collective 28.5s"),
    # Today's (no TORCH_NCCL_NONBLOCKING_TIMEOUT): killed at the bound with the abort pending.
    (marks(("init_returned", 3.0), ("abort_called", 5.0)), False, "(ii) the abort behind a waiting collective took"),
])
def test_abort_in_setup(tmp_path, monkeypatch, busy, ok, says):
    idle = Child(0, marks(("init_returned", 3.0), ("abort_called", 3.1), ("abort_returned", 3.4), ("left", 3.6),
                          extra="initialized False\n"), "", time.time())
    canned(monkeypatch, idle, Child(0 if ok else None, busy, "", time.time()))
    outcome = checks_nccl.abort_in_setup(ctx(tmp_path))
    assert outcome.ok is ok and says in outcome.detail, outcome.detail
    assert outcome.figures["nonblocking_timeout"] == "30"


def test_abort_in_setup_says_when_the_init_never_returned(tmp_path, monkeypatch):
    canned(monkeypatch, Child(None, "", "", time.time()), Child(None, "", "", time.time()))
    outcome = checks_nccl.abort_in_setup(ctx(tmp_path))
    assert not outcome.ok and "init_process_group did not return" in outcome.detail


def test_commit_stall_reports_both_commits_against_one_copy(tmp_path, monkeypatch):
    # G13: the draining commit and the overlapped one, each against one D2H copy of the same bytes.
    import json

    from tests.gpu import checks_jobs

    figures = {"gpu": {"copy_s": 0.02, "step_s": 0.03,
                       "drain": {"stall_per_commit_s": 0.021, "stall_vs_copy": 1.05, "host_in_commit_s": 0.02},
                       "overlap": {"stall_per_commit_s": 0.001, "stall_vs_copy": 0.05, "host_in_commit_s": 0.0}}}

    def run_children(commands, envs, timeout_s, cwd=None):
        (tmp_path / "bench.json").write_text(json.dumps(figures))
        assert "--matmuls" in commands[0]
        return [Child(0, "", "", time.time())]

    monkeypatch.setattr(checks_jobs, "run_children", run_children)
    outcome = checks_jobs.commit_stall(ctx(tmp_path))
    assert outcome.ok and "drain 21.0 ms = 105%" in outcome.detail and "overlap 1.0 ms = 5%" in outcome.detail
