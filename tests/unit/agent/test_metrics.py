"""AgentMetrics: synthetic events and progress marks in, Prometheus families out
(parsed with prometheus_client's own parser, as a scraper would); /metrics over HTTP."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic.agent.health import HealthServer
from elastic.agent.metrics import AgentMetrics, round_change
from elastic.contract.progress import Marks, ProgressBoard
from elastic.rendezvous.rounds import RoundPlan, Slot

HOST = "h1"


def samples(metrics: AgentMetrics) -> dict:
    """{(sample name, sorted labels): value} of one exposition."""
    text = metrics.exposition().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: AgentMetrics, name: str, **labels) -> float:
    return samples(metrics)[(name, tuple(sorted((k, str(v)) for k, v in labels.items())))]


def ev(name: str, **fields) -> dict:
    return {"time": 1700000000.0, "event": name, "host": HOST, "round": None, "rank": None, **fields}


def plan(round_number: int, workers: list[str], lost: tuple = ()) -> RoundPlan:
    slots = tuple(Slot(w.split(".")[0], w) for w in workers)
    hosts = {s.member_id: (s.member_id, "127.0.0.1") for s in slots}
    return RoundPlan(round_number, slots, hosts, "127.0.0.1:1", 0.0, lost)


# --- round_change: why a round replaced the previous one ---------------------------


@pytest.mark.parametrize(
    "previous, new, kind",
    [
        (None, plan(1, ["a.w0", "b.w0"]), "start"),
        (None, plan(4, ["a.w0", "b.w0"]), "join"),  # this host joined a running job
        (plan(1, ["a.w0", "b.w0"]), plan(2, ["a.w0"], lost=("b.w0",)), "failure"),
        (plan(1, ["a.w0", "b.w0"]), plan(2, ["a.w0"]), "leave"),
        (plan(1, ["a.w0"]), plan(2, ["a.w0", "b.w0"]), "join"),
        (plan(1, ["a.w0", "b.w0"]), plan(2, ["a.w0", "b.w0"]), "reset"),
        # a replacement admitted together with the loss: still a failure
        (plan(1, ["a.w0", "b.w0"]), plan(2, ["a.w0", "b.w1"], lost=("b.w0",)), "failure"),
    ],
)
def test_round_change_names_why_the_round_changed(previous, new, kind):
    change = round_change(previous, new)
    assert change["kind"] == kind
    assert change["round"] == new.round and change["world_size"] == new.world_size


def test_round_change_counts_lost_joined_and_left_workers():
    change = round_change(plan(3, ["a.w0", "b.w0", "c.w0"]), plan(4, ["a.w0", "d.w0"], lost=("b.w0",)))
    assert (change["lost"], change["joined"], change["left"]) == (1, 1, 1)


# --- events -> metrics ----------------------------------------------------------------------


def test_every_name_starts_with_elastic_and_kinds_show_before_they_happen():
    metrics = AgentMetrics(host=HOST)
    names = {name for name, _ in samples(metrics)}
    assert names and all(n.startswith("elastic_") for n in names)
    for kind in ("failure", "leave", "join", "reset"):
        assert value(metrics, "elastic_reformations_total", kind=kind) == 0


def test_rounds_set_world_size_and_round_and_count_reformations_by_kind():
    metrics = AgentMetrics(host=HOST)
    metrics.observe(ev("round_started", round=1, world_size=3, kind="start"))
    assert value(metrics, "elastic_round") == 1 and value(metrics, "elastic_world_size") == 3
    assert value(metrics, "elastic_reformations_total", kind="failure") == 0
    metrics.observe(ev("round_started", round=2, world_size=2, kind="failure"))
    metrics.observe(ev("round_started", round=2, world_size=2, kind="failure"))  # told again: etcd was away
    metrics.observe(ev("round_started", round=3, world_size=3, kind="join"))
    assert value(metrics, "elastic_round") == 3 and value(metrics, "elastic_world_size") == 3
    assert value(metrics, "elastic_reformations_total", kind="failure") == 1
    assert value(metrics, "elastic_reformations_total", kind="join") == 1


def test_an_older_round_never_moves_the_gauges_back():
    metrics = AgentMetrics(host=HOST)
    metrics.observe(ev("round_formed", round=5, world_size=4, reason="1 worker(s) joined"))
    metrics.observe(ev("reform_done", round=4, world_size=3, failed=True, total_s=1.0))
    assert value(metrics, "elastic_round") == 5 and value(metrics, "elastic_world_size") == 4


def test_events_of_another_host_are_ignored():
    metrics = AgentMetrics(host=HOST)
    metrics.observe({**ev("round_started", round=7, world_size=9, kind="join"), "host": "other"})
    assert value(metrics, "elastic_round") == 0


def test_recovery_phases_are_observed_once_per_round():
    metrics = AgentMetrics(host=HOST)
    done = dict(world_size=2, failed=True, detect_s=0.02, rendezvous_s=0.4, pg_init_s=0.3, sync_s=0.1, total_s=0.9)
    metrics.observe(ev("reform_done", round=2, rank=0, **done))
    metrics.observe(ev("reform_done", round=2, rank=1, **{**done, "total_s": 5.0}))  # same round, other worker
    metrics.observe(ev("reform_done", round=3, rank=0, **{**done, "failed": False, "total_s": 0.2}))
    for phase in ("detect", "rendezvous", "pg_init", "sync", "total"):
        assert value(metrics, "elastic_recovery_seconds_count", phase=phase, kind="failure") == 1
    assert value(metrics, "elastic_recovery_seconds_sum", phase="total", kind="failure") == pytest.approx(0.9)
    assert value(metrics, "elastic_recovery_seconds_bucket", phase="total", kind="failure", le="1.0") == 1
    assert value(metrics, "elastic_recovery_seconds_bucket", phase="total", kind="failure", le="0.5") == 0
    assert value(metrics, "elastic_recovery_seconds_count", phase="total", kind="planned") == 1


def test_workers_started_beyond_the_first_ones_are_restarts():
    metrics = AgentMetrics(host=HOST)
    metrics.observe(ev("agent_started", workers=2))
    metrics.observe(ev("worker_started", worker="m.w0", rank=0))
    metrics.observe(ev("worker_started", worker="m.w1", rank=1))
    assert value(metrics, "elastic_worker_restarts_total") == 0
    metrics.observe(ev("worker_started", worker="m.w2", rank=1))
    assert value(metrics, "elastic_worker_restarts_total") == 1


def test_the_last_durable_checkpoint_and_failures():
    metrics = AgentMetrics(host=HOST)
    metrics.observe(ev("checkpoint_written", step=40, bytes=12345, seconds=0.25, path="/c/step-40"))
    metrics.observe(ev("checkpoint_failed", step=50, error="disk full"))
    assert value(metrics, "elastic_checkpoint_last_timestamp_seconds") == 1700000000.0
    assert value(metrics, "elastic_checkpoint_last_step") == 40
    assert value(metrics, "elastic_checkpoint_last_bytes") == 12345
    assert value(metrics, "elastic_checkpoint_last_write_seconds") == 0.25
    assert value(metrics, "elastic_checkpoint_failures_total") == 1


def test_straggler_scores_per_worker_go_when_the_worker_exits():
    metrics = AgentMetrics(host=HOST)
    metrics.observe(ev("step_times", rank=1, worker="m.w1", steps=20, step_s=0.3, compute_s=0.25, straggler_score=3.1))
    assert value(metrics, "elastic_straggler_score", worker="m.w1", rank=1) == pytest.approx(3.1)
    metrics.observe(ev("worker_exited", worker="m.w1", exit_code=-9, rank=1))
    assert ("elastic_straggler_score", (("rank", "1"), ("worker", "m.w1"))) not in samples(metrics)


def test_straggler_reports_and_evictions_are_counted():
    metrics = AgentMetrics(host=HOST)
    assert value(metrics, "elastic_straggler_evictions_total") == 0
    for _ in range(2):
        metrics.observe(ev("straggler_detected", rank=2, worker="m.w1", ratio=3.1, windows=3, remaining=2))
    metrics.observe(ev("straggler_evicted", worker="m.w1", ratio=3.1, remaining=2, min_np=2))
    assert value(metrics, "elastic_straggler_reports_total", worker="m.w1") == 2
    assert value(metrics, "elastic_straggler_evictions_total") == 1
    # Another host's report (a shared log directory) is not this agent's.
    metrics.observe({**ev("straggler_detected", rank=0, worker="x.w0", ratio=2.0), "host": "h2"})
    assert ("elastic_straggler_reports_total", (("worker", "x.w0"),)) not in samples(metrics)


def test_a_survivor_renumbered_by_a_reformation_keeps_its_straggler_score_under_its_new_rank():
    """A real kill (tests/integration/test_metrics.py): the survivor of rank 2 becomes
    rank 1, its step time moves to the new label at the agent's next look at the marks,
    and its score went with the old label until its next window: a survivor whose rank
    stayed kept its score, so the ring showed one score of two."""
    metrics = AgentMetrics(host=HOST)
    for rank, worker in enumerate(["m.w0", "m.w1", "m.w2"]):
        metrics.observe(ev("step_times", rank=rank, worker=worker, steps=10, step_s=0.1, compute_s=0.1,
                           straggler_score=1.0 + rank / 10))
    metrics.observe_marks({w: Marks(commits=10, steps=9, step_total=0.9) for w in ["m.w0", "m.w1", "m.w2"]},
                          plan(1, ["m.w0", "m.w1", "m.w2"]))
    metrics.observe(ev("worker_exited", worker="m.w1", exit_code=None, rank=1))
    metrics.observe_marks({w: Marks(commits=12, steps=11, step_total=1.1) for w in ["m.w0", "m.w2"]},
                          plan(2, ["m.w0", "m.w2"]))
    scores = {labels: v for (name, labels), v in samples(metrics).items() if name == "elastic_straggler_score"}
    assert scores == {(("rank", "0"), ("worker", "m.w0")): pytest.approx(1.0),
                      (("rank", "1"), ("worker", "m.w2")): pytest.approx(1.2)}, scores
    metrics.observe(ev("step_times", rank=1, worker="m.w2", steps=10, step_s=0.1, compute_s=0.1, straggler_score=0.9))
    assert value(metrics, "elastic_straggler_score", worker="m.w2", rank=1) == pytest.approx(0.9)


# --- progress marks -> commits and step time --------------------------------------------


def test_commits_count_once_per_ring_and_step_time_is_the_mean_of_the_new_intervals():
    metrics = AgentMetrics(host=HOST)
    ring = plan(1, ["m.w0", "m.w1"])
    metrics.observe_marks({"m.w0": Marks(commits=5, steps=4, step_total=2.0),
                           "m.w1": Marks(commits=5, steps=4, step_total=2.4)}, ring)
    assert value(metrics, "elastic_commits_total") == 5  # two workers, the same five commits
    assert value(metrics, "elastic_step_seconds", worker="m.w0", rank=0) == pytest.approx(0.5)
    metrics.observe_marks({"m.w0": Marks(commits=9, steps=8, step_total=2.8),
                           "m.w1": Marks(commits=9, steps=8, step_total=3.2)}, ring)
    assert value(metrics, "elastic_commits_total") == 9
    assert value(metrics, "elastic_step_seconds", worker="m.w1", rank=1) == pytest.approx(0.2)


def test_a_replacement_worker_counts_from_zero_and_its_rank_label_follows_the_plan():
    metrics = AgentMetrics(host=HOST)
    metrics.observe_marks({"m.w0": Marks(commits=10, steps=9, step_total=9.0)}, plan(1, ["m.w0", "x.w0"]))
    metrics.observe(ev("worker_exited", worker="m.w0", exit_code=-9, rank=0))
    metrics.observe_marks({"m.w1": Marks(commits=2, steps=1, step_total=1.5)}, plan(3, ["x.w0", "m.w1"]))
    assert value(metrics, "elastic_commits_total") == 12
    got = samples(metrics)
    assert ("elastic_step_seconds", (("rank", "0"), ("worker", "m.w0"))) not in got
    assert got[("elastic_step_seconds", (("rank", "1"), ("worker", "m.w1")))] == pytest.approx(1.5)


def test_the_board_counts_commits_and_step_intervals(tmp_path):
    path = str(tmp_path / "board")
    ProgressBoard.create(path)
    writer, reader = ProgressBoard(path, writable=True), ProgressBoard(path, writable=False)
    try:
        writer.mark(100.0, interval=False)  # entering the training function
        writer.mark(103.0, interval=False, commit=True)  # a round's first commit: no interval
        writer.mark(103.5, interval=True, commit=True)
        writer.mark(104.5, interval=True, commit=True)
        writer.beat(104.6, 0.0, "train.py:12 in step")
        marks = reader.read()
        assert (marks.progress, marks.commits, marks.steps) == (4, 3, 2)
        assert marks.step_total == pytest.approx(1.5)
        assert marks.slowest == pytest.approx(1.0) and marks.where == "train.py:12 in step"
    finally:
        writer.close()
        reader.close()


# --- over HTTP ------------------------------------------------------------------------------


def test_the_health_server_serves_metrics_in_the_text_format():
    metrics = AgentMetrics(host=HOST)
    metrics.observe(ev("round_started", round=2, world_size=3, kind="failure"))
    with HealthServer(0, lambda: (True, "ok"), host="127.0.0.1", metrics=metrics.exposition) as server:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = response.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5) as response:
            assert response.status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["elastic_world_size"].samples[0].value == 3
    assert families["elastic_recovery_seconds"].type == "histogram"


def test_another_agents_workers_in_the_same_log_directory_are_not_our_restarts():
    metrics = AgentMetrics(host=HOST, member="h1-aaa")
    for member in ("h1-aaa", "h1-bbb"):  # two agents of one host id share the events file
        metrics.observe(ev("agent_started", member=member, workers=1))
        metrics.observe(ev("worker_started", worker=f"{member}.w0", rank=0))
    assert value(metrics, "elastic_worker_restarts_total") == 0
    metrics.observe(ev("worker_started", worker="h1-bbb.w1", rank=1))
    assert value(metrics, "elastic_worker_restarts_total") == 0
    metrics.observe(ev("worker_started", worker="h1-aaa.w1", rank=1))
    assert value(metrics, "elastic_worker_restarts_total") == 1


# --- sharded state: replica lag and re-shards ------------------------------------------------


def test_replica_lag_is_the_newest_commits_copy_time_or_its_age_while_in_flight(tmp_path):
    metrics = AgentMetrics(host=HOST)
    ring = plan(2, ["m.w0", "m.w1"])
    now = time.monotonic()
    metrics.observe_marks({"m.w0": Marks(replica_posted_at=now - 5.0, replica_done_at=now - 4.75),
                           "m.w1": Marks(replica_posted_at=now - 3.0, replica_done_at=now - 9.0),
                           "m.w2": Marks()}, ring)
    assert value(metrics, "elastic_shard_replica_lag_seconds", worker="m.w0", rank=0) == pytest.approx(0.25)
    # m.w1's newest copies are still travelling: their age so far.
    assert 3.0 <= value(metrics, "elastic_shard_replica_lag_seconds", worker="m.w1", rank=1) < 4.0
    # A worker that replicates nothing (a TorchState job) has no series.
    assert not any(name == "elastic_shard_replica_lag_seconds" and ("worker", "m.w2") in labels
                   for name, labels in samples(metrics))
    # The board carries both times.
    path = str(tmp_path / "board")
    ProgressBoard.create(path)
    board = ProgressBoard(path, writable=True)
    board.replica_posted(10.0)
    assert board.read().replica_lag(12.5) == 2.5
    board.replica_done(10.5)
    assert board.read().replica_lag(99.0) == 0.5
    board.close()


def test_reshards_count_once_per_round_and_bytes_add_up_over_the_hosts_workers():
    metrics = AgentMetrics(host=HOST)
    for worker, received in (("m.w0", 1000), ("m.w1", 3000)):
        metrics.observe(ev("resharded", round=3, worker=worker, source="memory", received_bytes=received,
                           seconds=0.4 if worker == "m.w0" else 0.6, replica_bytes_per_commit=500,
                           replicas_held_bytes=250))
    assert value(metrics, "elastic_reshards_total", source="memory") == 1
    assert value(metrics, "elastic_reshards_total", source="disk") == 0
    assert value(metrics, "elastic_reshard_received_bytes_total") == 4000
    assert value(metrics, "elastic_reshard_last_seconds") == 0.6
    assert value(metrics, "elastic_shard_replica_bytes_per_commit") == 1000
    assert value(metrics, "elastic_shard_replicas_held_bytes") == 500
    # The next round: one worker left; the gauges are the new ring's.
    metrics.observe(ev("worker_exited", worker="m.w1"))
    metrics.observe(ev("resharded", round=4, worker="m.w0", source="disk", received_bytes=0, seconds=2.0,
                       replica_bytes_per_commit=0, replicas_held_bytes=0))
    assert value(metrics, "elastic_reshards_total", source="disk") == 1
    assert value(metrics, "elastic_reshard_last_seconds") == 2.0
    assert value(metrics, "elastic_shard_replica_bytes_per_commit") == 0
