"""GET /metrics of a real job (embedded etcd, three gloo workers), parsed with
prometheus_client's own parser before and after one worker is SIGKILLed."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.jobs import Job, wait_until
from tests.fakes.pods import free_port

pytestmark = pytest.mark.timeout(240)


def scrape(port: int) -> dict:
    """{(sample name, sorted labels): value}, or {} while the endpoint is not up yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def get(sampled: dict, name: str, **labels) -> float:
    return sampled.get((name, tuple(sorted(labels.items()))), 0.0)


def by_name(sampled: dict, name: str) -> dict:
    return {labels: v for (n, labels), v in sampled.items() if n == name}


def test_metrics_follow_a_worker_kill(tmp_path):
    port = free_port()
    started = time.time()
    job = Job(tmp_path, Job.train_args(
        tmp_path / "out", tmp_path / "logs",
        ["--np", "3", "--min-np", "2", "--collective-timeout", "10", "--health-port", str(port),
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "5"],
        ["--steps", "100000", "--step-delay", "0.02"]))
    try:
        job.wait_for_step(10)
        before = wait_until(
            lambda: (s := scrape(port)) and get(s, "elastic_world_size") == 3 and get(s, "elastic_commits_total") >= 10
            and len(by_name(s, "elastic_step_seconds")) == 3 and get(s, "elastic_checkpoint_last_step") > 0
            and len(by_name(s, "elastic_straggler_score")) == 3 and s,
            90, "/metrics to show the running ring of three")
        assert get(before, "elastic_round") >= 1
        assert get(before, "elastic_reformations_total", kind="failure") == 0
        assert get(before, "elastic_recovery_seconds_count", phase="total", kind="failure") == 0
        assert get(before, "elastic_checkpoint_last_bytes") > 0
        assert get(before, "elastic_checkpoint_failures_total") == 0
        assert all(0 < v < 5 for v in by_name(before, "elastic_step_seconds").values())
        # Each worker's score is its compute time over the median of the ring's: with three
        # workers the median's own is 1 (the others' vary with the machine's load).
        scores = by_name(before, "elastic_straggler_score")
        assert {dict(labels)["rank"] for labels in scores} == {"0", "1", "2"}, scores
        assert min(scores.values()) <= 1.0 <= max(scores.values()) and all(0 < v < 5 for v in scores.values()), \
            scores
        # The last durable checkpoint: when (published during this run), which commit, how long it took.
        assert started <= get(before, "elastic_checkpoint_last_timestamp_seconds") <= time.time()
        assert get(before, "elastic_checkpoint_last_write_seconds") > 0
        killed = next(e["worker"] for e in job.events() if e["event"] == "worker_started" and e["rank"] == 1)

        os.kill(job.worker_pid(1), signal.SIGKILL)
        after = wait_until(
            lambda: (s := scrape(port)) and get(s, "elastic_world_size") == 2
            and get(s, "elastic_recovery_seconds_count", phase="total", kind="failure") >= 1 and s,
            90, "/metrics to show the ring re-formed without the killed worker")
        assert get(after, "elastic_round") > get(before, "elastic_round")
        assert get(after, "elastic_reformations_total", kind="failure") == 1
        assert get(after, "elastic_worker_restarts_total") == 0  # --max-restarts 0: nobody replaced
        # One observation per phase for each re-formation (one here, unless the loaded
        # machine made a round fail while forming).
        counts = {p: get(after, "elastic_recovery_seconds_count", phase=p, kind="failure")
                  for p in ("detect", "rendezvous", "pg_init", "sync", "total")}
        assert len(set(counts.values())) == 1 and counts["total"] >= 1, counts
        total = get(after, "elastic_recovery_seconds_sum", phase="total", kind="failure")
        assert 0 < total < 60
        # The dead worker's series are gone; the ring goes on committing.
        assert len(by_name(after, "elastic_step_seconds")) == 2
        assert len(by_name(after, "elastic_straggler_score")) == 2
        assert killed not in {dict(labels)["worker"] for labels in by_name(after, "elastic_straggler_score")}
        # ... and rank 0 goes on writing durable checkpoints: the gauges move on.
        later = wait_until(
            lambda: (s := scrape(port)) and get(s, "elastic_commits_total") > get(after, "elastic_commits_total")
            and get(s, "elastic_checkpoint_last_step") > get(after, "elastic_checkpoint_last_step") and s,
            60, "commits and a durable checkpoint after the re-formation")
        assert get(later, "elastic_checkpoint_last_timestamp_seconds") > get(
            before, "elastic_checkpoint_last_timestamp_seconds")
        assert get(later, "elastic_checkpoint_last_bytes") > 0
        assert get(later, "elastic_checkpoint_failures_total") == 0
        assert job.proc.poll() is None, job.text()[-3000:]  # the agent lives on (no exception in its loop)
    finally:
        job.kill()  # the job's end is other tests' business: not waited for here
