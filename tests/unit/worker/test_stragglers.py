"""Stragglers: the scores, persistence, when eviction is allowed, what a window measures."""

from __future__ import annotations

import threading
import time

import pytest

from elastic.contract.straggler_policy import StragglerOptions, eviction_allowed
from elastic.worker.stragglers import Persistence, StragglerWatch, WaitClock, scores
from tests.fakes.ring import FakeRing, Recorder


def test_scores_are_compute_time_over_the_median():
    assert scores([0.1, 0.1, 0.3]) == pytest.approx([1.0, 1.0, 3.0])
    assert scores([0.2, 0.1, 0.4, 0.1]) == pytest.approx([4 / 3, 2 / 3, 8 / 3, 2 / 3])
    assert scores([0.0, 0.0]) == [1.0, 1.0]  # nothing measured: nobody is slow
    assert scores([0.5]) == [1.0]


def test_a_straggler_is_reported_after_three_windows_in_a_row_and_once_per_run():
    p = Persistence(ratio=1.5, windows=3)
    workers = ["a", "b", "c"]
    assert p.update(workers, [1.0, 1.0, 3.0]) == []
    assert p.update(workers, [1.0, 1.0, 3.0]) == []
    assert p.update(workers, [1.0, 1.0, 3.0]) == ["c"]
    assert p.update(workers, [1.0, 1.0, 3.0]) == []  # still slow: not reported again
    assert p.run_of("c") == 4


def test_one_fast_window_breaks_the_run():
    p = Persistence(ratio=1.5, windows=3)
    workers = ["a", "b", "c"]
    for window in ([1, 1, 3], [1, 1, 3], [1, 1, 1.4], [1, 1, 3], [1, 1, 3]):
        assert p.update(workers, window) == []
    assert p.update(workers, [1, 1, 3]) == ["c"]


def test_exactly_the_ratio_is_not_slow_and_a_new_ring_starts_counting_again():
    p = Persistence(ratio=1.5, windows=2)
    assert p.update(["a", "b"], [1.5, 1.0]) == []
    assert p.update(["a", "b"], [1.6, 1.0]) == []
    p.reset()
    assert p.update(["a", "b"], [1.6, 1.0]) == []
    assert p.update(["a", "b"], [1.6, 1.0]) == ["a"]


def test_several_stragglers_in_one_window_slowest_first():
    p = Persistence(ratio=1.5, windows=1)
    assert p.update(["a", "b", "c", "d", "e"], [2.0, 1.0, 3.0, 1.0, 1.0]) == ["c", "a"]


def test_eviction_only_while_the_rest_stays_at_or_above_min_np():
    assert eviction_allowed(world_size=3, leaving=1, min_np=2)
    assert not eviction_allowed(world_size=3, leaving=1, min_np=3)
    assert not eviction_allowed(world_size=4, leaving=2, min_np=3)  # a host of two workers
    assert not eviction_allowed(world_size=3, leaving=0, min_np=1)



def test_the_wait_clock_counts_idle_waits_in_collectives_not_sleeps_in_user_code():
    import torch.distributed.distributed_c10d as c10d_module  # a module whose frames are collectives

    clock = WaitClock(interval=0.005).start()
    try:
        time.sleep(0.3)  # idle in user code: no wait on peers
        in_user = clock.waiting_s
        event = threading.Event()
        # A frame of torch.distributed, idle: what a main thread waiting for a peer looks like.
        waiter = eval("lambda: event.wait(0.3)", {"__name__": c10d_module.__name__, "event": event})
        waiter()
        in_collective = clock.waiting_s - in_user
        started, busy_before = time.monotonic(), clock.waiting_s
        eval("lambda: sum(i * i for i in range(1_000_000))", {"__name__": c10d_module.__name__})()
        busy = clock.waiting_s - busy_before
        busy_took = time.monotonic() - started
    finally:
        clock.stop()
    assert in_user < 0.05
    assert 0.15 < in_collective < 0.45
    assert busy < 0.5 * busy_took  # computing in those frames (a backward) is no wait


class _FakeClock:
    waiting_s = 0.0

    def stop(self):
        pass


def test_a_window_is_every_k_commits_after_the_rounds_first(caplog):
    events = Recorder()
    emitted = events.emitted
    clock = _FakeClock()
    watch = StragglerWatch(events, "w0", ratio=1.5, clock=clock, every=2, windows=1, min_window_s=0.0)
    watch.begin_round(FakeRing(round=1))
    watch.on_commit(1)  # the round's first commit starts the window
    clock.waiting_s = 0.01
    watch.on_commit(2)
    assert emitted == []
    clock.waiting_s = 0.02
    watch.on_commit(3)
    [(name, fields)] = emitted
    assert name == "step_times"
    assert fields["worker"] == "w0" and fields["steps"] == 2 and fields["straggler_score"] == 1.0
    assert fields["compute_s"] == pytest.approx(max(0.0, fields["step_s"] - 0.01), abs=1e-4)
    assert fields["console"] is False  # periodic: kept off the console


class _Counting(StragglerWatch):
    """Records the commits at which it exchanges (the all_gather a real ring would do)."""

    exchanges: list

    def _gather(self, elapsed, blocked):
        self.exchanges.append(self._commit)
        return super()._gather(elapsed, blocked)


def _paced_watch(step_s: float, **options):
    events, now = Recorder(), [0.0]
    emitted = events.emitted
    watch = _Counting(events, "w0", ratio=1.5, clock=_FakeClock(), windows=1, now=lambda: now[0], **options)
    watch.exchanges = []
    watch.begin_round(FakeRing(round=1))

    def commit(number):
        now[0] += step_s
        watch._commit = number
        watch.on_commit(number)

    return watch, emitted, commit


def test_a_short_window_grows_until_it_spans_the_minimum_then_exchanges_come_every_target_span():
    # 50 ms steps: the first exchange (10 commits after the first, 0.5 s) is too short for
    # a window of 1 s; it asks for the 10 more commits that make one. Then, at this pace,
    # the next exchange is 2 s (40 commits) away: one all_gather per 2 s, not per 10 commits.
    watch, emitted, commit = _paced_watch(0.05, every=10, min_window_s=1.0, target_window_s=2.0)
    for number in range(1, 202):
        commit(number)
    assert watch.exchanges == [11, 21, 61, 101, 141, 181]
    assert [f["steps"] for _, f in emitted] == [20, 40, 40, 40, 40]
    assert all(f["step_s"] == pytest.approx(0.05) for _, f in emitted)


def test_slow_steps_exchange_every_k_commits_at_least():
    # 0.5 s steps: 2 s would be 4 commits; never closer than `every` (10) commits.
    watch, emitted, commit = _paced_watch(0.5, every=10, min_window_s=1.0, target_window_s=2.0)
    for number in range(1, 42):
        commit(number)
    assert watch.exchanges == [11, 21, 31, 41]
    assert [f["steps"] for _, f in emitted] == [10, 10, 10, 10]


def test_very_short_steps_exchange_at_most_max_window_commits_apart():
    from elastic.worker.stragglers import MAX_WINDOW_COMMITS

    watch, _, commit = _paced_watch(0.0001, every=10, min_window_s=1.0, target_window_s=2.0)
    for number in range(1, 2 * MAX_WINDOW_COMMITS + 20):
        commit(number)
    assert watch.exchanges == [11, 11 + MAX_WINDOW_COMMITS, 11 + 2 * MAX_WINDOW_COMMITS]


# -- the options ----------------------------------------------------------------------
@pytest.fixture
def script(tmp_path, monkeypatch):
    for name in ("ELASTIC_STRAGGLER_RATIO", "ELASTIC_EVICT_STRAGGLERS"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_the_options_and_their_environment_forms(script, monkeypatch):
    from elastic.cli.launch import parse

    assert parse(["--np", "2", script])[0].stragglers == StragglerOptions(ratio=1.5, evict=False)
    config, _ = parse(["--np", "2", "--straggler-ratio", "2.5", "--evict-stragglers", script, "--evict-stragglers"])
    assert config.stragglers == StragglerOptions(ratio=2.5, evict=True)
    assert config.command == (script, "--evict-stragglers")  # after SCRIPT: the script's
    monkeypatch.setenv("ELASTIC_STRAGGLER_RATIO", "3")
    monkeypatch.setenv("ELASTIC_EVICT_STRAGGLERS", "yes")
    assert parse(["--np", "2", script])[0].stragglers == StragglerOptions(ratio=3.0, evict=True)
    monkeypatch.setenv("ELASTIC_EVICT_STRAGGLERS", "0")
    assert parse(["--np", "2", script])[0].stragglers.evict is False


@pytest.mark.parametrize("argv, env, message", [
    (["--straggler-ratio", "1"], {}, "argument --straggler-ratio: invalid number above 1 value: '1'"),
    ([], {"ELASTIC_STRAGGLER_RATIO": "fast"}, "ELASTIC_STRAGGLER_RATIO='fast': expected a number above 1"),
    ([], {"ELASTIC_EVICT_STRAGGLERS": "maybe"},
     "ELASTIC_EVICT_STRAGGLERS='maybe': expected 1/true/yes/on or 0/false/no/off"),
])
def test_bad_values_are_one_line_and_exit_2(script, monkeypatch, capsys, argv, env, message):
    from elastic.cli.launch import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["--np", "2", *argv, script]) == 2
    assert capsys.readouterr().err == f"elastic-run: error: {message}\n"
