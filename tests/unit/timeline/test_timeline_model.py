"""The timeline model: events in, lanes, failures, re-formations and a headline out."""

from __future__ import annotations

import pytest

from elastic.timeline import build
from elastic.cli.timeline import load, main

T0 = 1_000_000.0
A, B = "hostA-1-aaaaaa", "hostB-2-bbbbbb"


def ev(t, event, **fields):
    return {"time": T0 + t, "event": event, "host": fields.pop("host", "hostA"), "round": fields.pop("round", None),
            "rank": fields.pop("rank", None), **fields}


def steps(t0, t1, worker, first, last, rnd, rank, world):
    return ev(t1, "steps", worker=worker, first=first, last=last, start=T0 + t0, end=T0 + t1, round=rnd,
              rank=rank, world_size=world)


def reform(t, worker, rank, rnd, world, total, release=0.01, rendezvous=0.02, pg_init=0.03, sync=0.01,
           failed=True, commit=10):
    return ev(t, "reform_done", worker=worker, rank=rank, round=rnd, world_size=world, failed=failed,
              detect_s=release, rendezvous_s=rendezvous, pg_init_s=pg_init, sync_s=sync, total_s=total, commit=commit)


def kill_and_join_events():
    """3 workers on hostA; w2 killed at 5.0; hostB joins at 8.0 and the ring switches at 9.0."""
    w = [f"{A}.w{i}" for i in range(3)]
    events = [ev(0, "agent_started", member=A), ev(0.01, "member_joined", member=A),
              ev(0.05, "round_formed", round=1, world_size=3)]
    events += [ev(0.1, "worker_started", worker=w[i], pid=100 + i, rank=i, round=1) for i in range(3)]
    for i in range(3):
        events += [steps(1.0, 2.0, w[i], 1, 10, 1, i, 3), steps(2.0, 4.9, w[i], 11, 12, 1, i, 3)]
    events += [ev(5.0, "worker_exited", worker=w[2], exit_code=None, signal=9, round=1),
               ev(5.001, "failure_detected", reason=f"worker {w[2]} died (signal 9)", round=1),
               reform(5.2, w[0], 0, 2, 2, total=0.15), reform(5.25, w[1], 1, 2, 2, total=0.2)]
    events += [steps(5.25, 9.0, w[i], 13, 20, 2, i, 2) for i in range(2)]
    events += [ev(8.0, "agent_started", member=B, host="hostB"), ev(8.0, "member_joined", member=B, host="hostB"),
               ev(8.1, "worker_started", worker=f"{B}.w0", pid=200, rank=2, round=3, host="hostB"),
               reform(9.1, w[0], 0, 3, 3, total=0.1, failed=False, commit=20),
               reform(9.1, w[1], 1, 3, 3, total=0.1, failed=False, commit=20),
               steps(9.1, 12.0, f"{B}.w0", 21, 30, 3, 2, 3, ) | {"host": "hostB"},
               ev(12.5, "job_finished", status="succeeded", reason="done")]
    return events


def test_a_kill_and_a_join_give_lanes_failures_reformations_and_a_world_size_line():
    tl = build(list(reversed(kill_and_join_events())))  # any order
    assert tl.t0 == T0 and tl.end == pytest.approx(12.5)
    assert [lane.worker.rsplit(".", 1)[-1] for lane in tl.lanes] == ["w0", "w1", "w2", "w0"]
    assert [lane.steps for lane in tl.lanes] == [20, 20, 12, 10]
    killed = tl.lanes[2]
    assert killed.signal == 9 and killed.exited == pytest.approx(5.0)
    [failure] = tl.failures
    assert failure.kind == "killed" and failure.worker == f"{A}.w2" and failure.time == pytest.approx(5.0)
    broke, switched = tl.reformations
    assert broke.failed and broke.round == 2 and broke.world_size == 2 and broke.cause is failure
    assert broke.start == pytest.approx(5.0) and broke.end == pytest.approx(5.25)
    assert not switched.failed and switched.cause is None and switched.world_size == 3
    assert [c.kind for c in tl.changes] == ["joined"] and tl.changes[0].host == "hostB"
    assert tl.world == [(pytest.approx(1.0), 3), (pytest.approx(5.25), 2), (pytest.approx(9.1), 3)]
    assert tl.outcome == "succeeded"
    assert tl.steps_before(5.05) == 12 and broke.resumed_commit == 10


def test_the_headline_says_what_happened():
    tl = build(kill_and_join_events())
    assert tl.headline() == ("3 workers, 1 killed at 5.0 s (recovered in 0.25 s), 1 host joined at 8.0 s, "
                             "succeeded at 12.5 s")


def test_phases_of_a_band_tile_it_from_the_failure_to_the_last_sync():
    tl = build(kill_and_join_events())
    phases = tl.reformations[0].phases()
    assert [p[0] for p in phases] == ["detect", "abort", "rendezvous", "pg init", "sync"]
    assert phases[0][1] == pytest.approx(5.0) and phases[-1][2] == pytest.approx(5.25)
    for (_, _, end), (_, start, _) in zip(phases, phases[1:]):
        assert end == pytest.approx(start)
    assert phases[-1][2] - phases[-1][1] == pytest.approx(0.01)  # the last worker's sync


def test_a_host_running_two_agents_labels_lanes_by_member():
    events = [ev(0.1, "worker_started", worker=f"{A}.w0", pid=1, rank=0, round=1),
              ev(0.2, "worker_started", worker="hostA-9-cccccc.w0", pid=2, rank=1, round=1)]
    assert build(events).lane_labels() == ["hostA#aaaaaa w0 (rank 0)", "hostA#cccccc w0 (rank 1)"]


def test_exits_at_the_end_of_a_job_are_no_failures_and_a_quiet_job_has_a_plain_headline():
    events = [ev(0.1, "worker_started", worker=f"{A}.w0", pid=1, rank=0, round=1),
              steps(0.2, 3.0, f"{A}.w0", 1, 30, 1, 0, 1),
              ev(3.1, "worker_exited", worker=f"{A}.w0", exit_code=0, signal=None),
              ev(3.2, "job_finished", status="succeeded")]
    tl = build(events)
    assert tl.failures == [] and tl.reformations == []
    assert tl.headline() == "1 worker, succeeded at 3.1 s"  # times count from the first event


def test_no_events_is_an_error():
    with pytest.raises(ValueError):
        build([{"event": "x"}, {"time": "bad"}])


def test_the_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "-o", str(tmp_path / "x.png")]) == 1
    assert main([str(tmp_path), "-o", str(tmp_path / "x.png")]) == 1
    (tmp_path / "events.jsonl").write_text("not json\n")
    assert main([str(tmp_path), "-o", str(tmp_path / "x.png")]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(line.startswith("elastic-run timeline: error: ") for line in errors)
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_the_command_names_the_extra_in_one_line(tmp_path):
    import json
    import subprocess
    import sys

    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kill_and_join_events()))
    # A Python whose `import matplotlib` fails, as after `pip install elastic-run` without extras.
    hide = "import sys; sys.modules['matplotlib'] = None; from elastic.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", hide, "timeline", str(tmp_path), "-o", str(tmp_path / "t.png")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-run timeline: error: drawing the timeline needs "
                                                   "matplotlib"), done.stderr
    assert lines[0].endswith("install it with: pip install matplotlib (in a checkout: pip install -e '.[timeline]')")
    assert not (tmp_path / "t.png").exists()


def test_events_files_of_several_hosts_below_the_directory_are_merged(tmp_path):
    import json

    events = kill_and_join_events()
    for host in ("hostA", "hostB"):
        (tmp_path / host).mkdir()
        (tmp_path / host / "events.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in events if e["host"] == host) + '{"torn": ')
    tl = load(str(tmp_path))
    assert len(tl.lanes) == 4 and len(tl.reformations) == 2


def test_a_hung_worker_is_one_failure_of_its_own_kind():
    w = f"{A}.w1"
    events = [ev(0.1, "worker_started", worker=w, pid=1, rank=1, round=1),
              ev(9.0, "hang_detected", worker=w, rank=1, round=1, kind="frozen", stalled_s=8.0),
              ev(9.2, "worker_exited", worker=w, exit_code=None, signal=9),
              ev(9.2, "failure_detected", reason=f"worker {w} died (declared hung: frozen, no progress for 8.0s, signal 9)")]
    [failure] = build(events).failures
    assert failure.kind == "hung" and failure.worker == w and failure.time == pytest.approx(9.1)
