"""The end-of-run summary and the progress `elastic-run status` shows: pure functions, as tables."""

from __future__ import annotations

import pytest

from elastic.timeline import build
from elastic.timeline.progress import JobProgress, progress_of
from elastic.timeline.summary import duration, failures_lost, summarize

from .test_timeline_model import A, T0, ev, kill_and_join_events, reform, steps

W0 = f"{A}.w0"


def _plain_run():
    return [ev(0, "agent_started", member=A), ev(0.1, "worker_started", worker=W0, pid=1, rank=0, round=1),
            steps(1.0, 61.0, W0, 1, 600, 1, 0, 1), ev(61.5, "job_finished", status="succeeded", reason="done")]


def _failure_not_recovered():
    return [ev(0, "agent_started", member=A), ev(0.1, "worker_started", worker=W0, pid=1, rank=0, round=1),
            steps(1.0, 3.0, W0, 1, 20, 1, 0, 1), ev(3.5, "worker_exited", worker=W0, exit_code=1, signal=None),
            ev(3.6, "failure_detected", reason=f"worker {W0} failed (exit 1)", user_error=True),
            ev(4.0, "job_finished", status="failed", reason="error in user code")]


def _many_failures():
    events = _plain_run()[:2]
    for i in range(7):
        t = 10.0 * i
        events += [steps(t + 1, t + 5, W0, 10 * i + 1, 10 * i + 10, i + 1, 0, 2),
                   reform(t + 6, W0, 0, i + 2, 2, total=0.5, commit=10 * i + 5)]
    return events + [ev(80, "job_finished", status="succeeded", reason="done")]


def _torchrun_style_restarted():
    """A torchrun-style job (no commits): w1 killed, its agent restarts both workers, then success."""
    w1 = f"{A}.w1"
    return [ev(0, "agent_started", member=A), ev(0.1, "round_formed", world_size=2, round=1),
            ev(0.2, "worker_started", worker=W0, pid=1, rank=0, round=1),
            ev(0.2, "worker_started", worker=w1, pid=2, rank=1, round=1),
            ev(4.0, "worker_exited", worker=w1, exit_code=None, signal=9),
            ev(4.1, "failure_detected", reason=f"worker {w1} died (signal 9)"),
            ev(4.3, "worker_started", worker=W0, pid=3, rank=0, round=2),
            ev(4.5, "worker_started", worker=w1, pid=4, rank=1, round=2),
            ev(14.0, "job_finished", status="succeeded", reason="done")]


@pytest.mark.parametrize("events, log_dir, expected", [
    (_torchrun_style_restarted(), None, [  # was "after 0 steps ... rank 1 killed, not recovered"
        "elastic-run: summary: job j succeeded in 14 s, world 2",
        "  1 failure: 0.50 s lost (4% of the wall time)",
        "    at 0:04  failure: rank 1 killed, every worker restarted (torchrun-style) in 0.50 s",
        "  timeline: not kept (run with --log-dir to keep events.jsonl and draw it)",
    ]),
    (_plain_run(), "/logs", [
        "elastic-run: summary: job j succeeded after 600 steps in 62 s, world 1",
        "  no failures, joins or leaves",
        "  timeline: elastic-run timeline /logs -o timeline.png",
    ]),
    (kill_and_join_events(), None, [
        "elastic-run: summary: job j succeeded after 30 steps in 12 s, world 3",
        "  1 failure, 1 join: 1.1 s lost (9% of the wall time), 2 steps re-run",
        "    at 0:05  failure: rank 2 killed, 0.25 s to train again + 2 steps re-run (0.71 s)",
        "    at 0:08  join: world 2 -> 3, 0.10 s to train again",
        "  timeline: not kept (run with --log-dir to keep events.jsonl and draw it)",
    ]),
    (_failure_not_recovered(), "/l", [
        "elastic-run: summary: job j failed after 20 steps in 4.0 s, world 1",
        "  1 failure",
        "    at 0:03  failure: rank 0 failed, not recovered",
        "  timeline: elastic-run timeline /l -o timeline.png",
    ]),
])
def test_summary(events, log_dir, expected):
    assert summarize(build(events), job_id="j", log_dir=log_dir).split("\n") == expected


def test_a_long_list_of_failures_is_cut_and_counted():
    text = summarize(build(_many_failures()), log_dir="/l").split("\n")
    assert text[1].startswith("  7 failures: ")
    assert sum(line.startswith("    at ") for line in text) == 5
    assert "    ... 2 more (see the timeline)" in text


def test_failures_lost_so_far():
    assert failures_lost(build(_plain_run())) == (0, 0.0, 0)
    failures, lost, rerun = failures_lost(build(kill_and_join_events()))
    assert (failures, rerun) == (1, 2) and lost == pytest.approx(0.25 + 2 * 22.1 / 62)


@pytest.mark.parametrize("seconds, text", [(0.25, "0.25 s"), (4.04, "4.0 s"), (61, "61 s"), (125, "2 min 05 s"),
                                           (9000, "2.5 h")])
def test_duration(seconds, text):
    assert duration(seconds) == text


def _span(t0, t1, first, last, rnd=1, **extra):
    return {"start": T0 + t0, "end": T0 + t1, "first": first, "last": last, "round": rnd, "world_size": 2, **extra}


@pytest.mark.parametrize("spans, expected", [
    ([], None),
    ([_span(0, 1, 1, 10), _span(1, 2, 11, 20)], dict(step=20, steps_per_s=10.0, samples_per_s=None, eta=None)),
    # a new round: the rate is the new round's only
    ([_span(0, 1, 1, 100), _span(5, 7, 90, 99, rnd=2, total_steps=199)],
     dict(step=99, steps_per_s=5.0, eta=20.0)),
    ([_span(0, 1, 1, 10, samples_per_step=32)], dict(samples_per_s=320.0)),
    # the sampler's counts win over samples_per_step
    ([_span(0, 1, 1, 10, samples=100, epoch=0, epoch_samples=1000),
      _span(1, 3, 11, 20, samples=300, epoch=0, epoch_samples=1000, samples_per_step=1)],
     dict(samples_per_s=100.0, epoch_eta=7.0)),
    # a new epoch between the spans: no sample rate from them
    ([_span(0, 1, 1, 10, samples=900, epoch=0), _span(1, 2, 11, 20, samples=100, epoch=1)],
     dict(samples_per_s=None)),
])
def test_progress_of(spans, expected):
    progress = progress_of(spans)
    if expected is None:
        assert progress is None
        return
    for name, value in expected.items():
        got = {"eta": progress.eta_s, "epoch_eta": progress.epoch_eta_s}.get(name)
        got = got() if got else getattr(progress, name)
        assert got == (pytest.approx(value) if value is not None else None), name


@pytest.mark.parametrize("progress, now, expected", [
    (JobProgress(step=120, at=100.0, steps_per_s=4.0, samples_per_s=128.0, total_steps=1000), 103.0, [
        "progress: step 120 of 1000 (12%), 4 steps/s, 128 samples/s; last commit 3.0 s ago",
        "time left: about 3 min 40 s at this rate",
        "lost to failures: none so far",
    ]),
    (JobProgress(step=7, at=100.0, epoch=2, samples=50, epoch_samples=250, samples_per_s=10.0, failures=2,
                 lost_s=12.5, rerun_steps=30), 100.0, [
        "progress: step 7, 10 samples/s; last commit 0.00 s ago",
        "time left in epoch 2: about 20 s (50 of 250 samples)",
        "lost to failures: 12 s (2 failures, 30 steps re-run)",
    ]),
])
def test_status_lines(progress, now, expected):
    assert progress.lines(now) == expected


@pytest.mark.parametrize("raw", [b"", b"x", b"[]", b'{"step": "1", "at": 1}', b'{"step": 1}',
                                 b'{"step": 1, "at": 2, "lost_s": "a lot"}'])
def test_a_malformed_progress_record_is_refused(raw):
    with pytest.raises(ValueError):
        JobProgress.from_json(raw)


def test_progress_record_round_trip():
    p = JobProgress(step=3, at=1.5, steps_per_s=2.0, total_steps=10, failures=1, lost_s=0.5)
    assert JobProgress.from_json(p.to_json()) == p
