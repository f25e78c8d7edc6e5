"""The chaos report: kills matched to the recoveries the events show; the victim choice."""

from __future__ import annotations

import signal

import pytest

from elastic.agent.chaos import ChaosConfig, ChaosMonkey, Kill, build_report, format_report
from tests.unit.timeline.test_timeline_model import A, T0, ev, kill_and_join_events, reform, steps


def test_each_kill_gets_its_detection_phases_recovery_and_steps_rerun():
    events = kill_and_join_events()
    [report] = build_report([Kill(T0 + 5.0, f"{A}.w2", 100, 2)], events)
    assert report.recovered and report.round == 2 and report.world_size == 2
    assert report.at == pytest.approx(5.0)
    assert report.detect_s == pytest.approx(0.05)  # the first survivor noticed at 5.25 - 0.2
    assert report.total_s == pytest.approx(0.25)
    assert report.phases == {"abort": 0.01, "rendezvous": 0.02, "pg init": 0.03, "sync": 0.01}
    assert report.steps_rerun == 2  # reached commit 12, resumed from commit 10


def test_a_kill_without_a_recovery_is_reported_as_such():
    events = kill_and_join_events()[:3]
    [report] = build_report([Kill(T0 + 5.0, f"{A}.w2", 100, 2)], events)
    assert not report.recovered and report.total_s is None
    assert "no re-formation seen" in format_report([report])


def test_two_kills_each_find_their_own_recovery():
    w0, w1, w2 = (f"{A}.w{i}" for i in range(3))
    events = [ev(0, "agent_started"),
              steps(0.5, 1.9, w0, 1, 10, 1, 0, 3),
              ev(2.0, "worker_exited", worker=w1, signal=9), ev(2.0, "failure_detected", reason=f"worker {w1} died (signal 9)"),
              reform(2.3, w0, 0, 2, 2, total=0.2, commit=10),
              steps(2.3, 3.9, w0, 11, 20, 2, 0, 2),
              ev(4.0, "worker_exited", worker=w2, signal=9), ev(4.0, "failure_detected", reason=f"worker {w2} died (signal 9)"),
              reform(4.5, w0, 0, 3, 1, total=0.4, commit=20)]
    reports = build_report([Kill(T0 + 2.0, w1, 1, 1), Kill(T0 + 4.0, w2, 2, 2)], events)
    assert [(r.round, r.world_size) for r in reports] == [(2, 2), (3, 1)]
    assert [r.total_s for r in reports] == [pytest.approx(0.3), pytest.approx(0.5)]
    assert [r.steps_rerun for r in reports] == [0, 0]
    text = format_report(reports)
    assert text.splitlines()[0] == "chaos: 2 kills, 2 recovered; to the next step: median 0.400 s, max 0.500 s"
    assert len(text.splitlines()) == 4


def test_no_kill_says_so():
    assert build_report([], []) == []
    assert format_report([]).startswith("chaos: no worker was killed")


class FakeProc:
    def __init__(self, pid):
        self.pid, self.alive, self.stopping, self.signals = pid, True, False, []

    def signal(self, signum):
        self.signals.append(signum)


class FakeEvents:
    def __init__(self):
        self.emitted = []

    def emit(self, event, **fields):
        self.emitted.append((event, fields))


def monkey(workers, *, min_np, max_restarts):
    m = ChaosMonkey(ChaosConfig(10.0, seed=1), workers=workers, min_np=min_np, max_restarts=max_restarts,
                    events=FakeEvents(), out=lambda text: None)
    m._stop.set()  # no thread: the test calls _kill_one itself
    return m


def test_only_workers_steady_in_the_newest_round_are_killed_and_never_below_min_np():
    workers = {f"w{i}": FakeProc(10 + i) for i in range(3)}
    m = monkey(workers, min_np=2, max_restarts=0)
    assert not m._kill_one()  # nobody has reported steps yet
    for i in range(3):
        m.on_event({"event": "steps", "worker": f"w{i}", "round": 1, "rank": i, "world_size": 3})
    m.on_event({"event": "reform_done", "round": 2, "world_size": 3})  # a newer round: not steady yet
    assert not m._kill_one()
    for i in range(3):
        m.on_event({"event": "steps", "worker": f"w{i}", "round": 2, "rank": i, "world_size": 3})
    assert m._kill_one()
    [kill] = m.kills
    assert workers[kill.worker].signals == [signal.SIGKILL] and not workers[kill.worker].stopping
    assert m._events.emitted[0][0] == "chaos_kill"
    for i in range(3):
        m.on_event({"event": "steps", "worker": f"w{i}", "round": 3, "rank": i, "world_size": 2})
    assert not m._kill_one(), "2 workers left, min-np 2, no restarts: a kill would stop the job"


def test_with_restarts_left_a_kill_may_go_below_min_np_and_the_seed_repeats_the_intervals():
    m = monkey({"w0": FakeProc(1)}, min_np=1, max_restarts=1)
    m.on_event({"event": "steps", "worker": "w0", "round": 1, "rank": 0, "world_size": 1})
    assert m._kill_one()
    first, second = monkey({}, min_np=1, max_restarts=0), monkey({}, min_np=1, max_restarts=0)
    delays = [first.next_delay() for _ in range(5)]
    assert all(5.0 <= d <= 15.0 for d in delays) and len(set(delays)) == 5
    assert [second.next_delay() for _ in range(5)] == delays  # --chaos-seed repeats them


def test_the_options_and_their_environment_form(tmp_path, monkeypatch):
    from elastic.cli.launch import parse

    script = tmp_path / "train.py"
    script.write_text("")
    config, _ = parse(["--np", "2", "--chaos-kill-every", "7.5", "--chaos-seed", "3", str(script)])
    assert config.chaos == ChaosConfig(7.5, 3)
    assert parse(["--np", "2", str(script)])[0].chaos is None
    monkeypatch.setenv("ELASTIC_CHAOS_KILL_EVERY", "4")
    assert parse(["--np", "2", str(script)])[0].chaos == ChaosConfig(4.0, None)
