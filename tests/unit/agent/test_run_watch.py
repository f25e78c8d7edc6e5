"""RunWatch: rank 0's step records become published progress; the run's record stays compact."""

from __future__ import annotations

import json
import threading

from elastic.agent import run_watch
from elastic.agent.run_watch import RunRecord, RunWatch

T0 = 1_000_000.0


def _steps(worker, first, last, start, end, rank=0, rnd=1, **extra):
    return {"time": T0 + end, "event": "steps", "host": "h", "worker": worker, "rank": rank, "round": rnd,
            "first": first, "last": last, "start": T0 + start, "end": T0 + end, "world_size": 2, **extra}


def test_the_record_merges_a_workers_touching_spans_of_one_round():
    record = RunRecord()
    for i in range(100):
        record.add(_steps("h.w0", 10 * i + 1, 10 * i + 10, i, i + 1))
    record.add(_steps("h.w0", 1001, 1010, 100, 101, rnd=2))  # a new round: a new span
    record.add({"time": T0, "event": "step_times", "worker": "h.w0"})  # not the timeline's
    record.add({"time": T0, "event": "worker_started", "worker": "h.w0", "pid": 1, "rank": 0})
    spans = [e for e in record.events if e["event"] == "steps"]
    assert [(s["first"], s["last"], s["round"]) for s in spans] == [(1, 1000, 1), (1001, 1010, 2)]
    assert spans[0]["start"] == T0 and spans[0]["end"] == T0 + 100
    assert len(record.events) == 3


def test_rank_0s_steps_are_published_off_the_caller_and_other_ranks_are_not(monkeypatch):
    monkeypatch.setattr(run_watch, "PUBLISH_S", 0.01)
    published = []
    sent = threading.Event()
    watch = RunWatch(job_id="j", log_dir=None, publish=lambda v: (published.append(json.loads(v)), sent.set()),
                     out=lambda _text: None)
    watch.on_event(_steps("h.w1", 1, 10, 0, 1, rank=1))
    assert watch._thread is None  # nothing of rank 0 yet
    watch.on_event(_steps("h.w0", 1, 10, 0, 1, total_steps=100))
    assert sent.wait(5)
    watch.finish()
    assert published[-1]["step"] == 10 and published[-1]["total_steps"] == 100
    assert published[-1]["steps_per_s"] == 10.0


def test_a_failing_publish_never_reaches_the_caller(monkeypatch):
    monkeypatch.setattr(run_watch, "PUBLISH_S", 0.01)
    tried = threading.Event()

    def publish(_value):
        tried.set()
        raise ConnectionError("etcd away")

    lines = []
    watch = RunWatch(job_id="j", log_dir="/logs", publish=publish, out=lines.append)
    watch.on_event({"time": T0, "event": "agent_started", "host": "h", "member": "m"})
    watch.on_event(_steps("h.w0", 1, 10, 0, 1))
    assert tried.wait(5)
    text = watch.finish([{"time": T0 + 2, "event": "job_finished", "host": "h", "status": "succeeded"}])
    assert lines == [text] and text.startswith("elastic-run: summary: job j succeeded after 10 steps in 2.0 s")
