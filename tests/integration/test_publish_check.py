"""The publish check of durable checkpoints (``Ring.publish_check``), against a real etcd.

A write carries the round it was made in; right before publishing, the writer asks
the check whether the job has moved on without this worker. The plans are written
as the coordinator writes them: ``control/plan`` and ``rounds/<n>`` together.

The case that matters most: a host cut off, declared lost, then healed. Its agent
registers again under the same member id and offers the same worker ids, so its
worker (the same process, a write of the old round still in flight) is in the newest
plan again. That plan alone cannot tell it from a worker that never left.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

from elastic.checkpoint import CheckpointPolicy, DurableWriter, PublishRefusal, list_checkpoints
from elastic.contract.worker_config import WorkerConfig
from elastic.rendezvous import Etcd, EtcdConfig, JobKeys, JobStatus, RoundPlan
from elastic.rendezvous.control import FAILED, SUCCEEDED
from elastic.rendezvous.etcd import Delete, Put
from elastic.rendezvous.keys import KEEP_ROUNDS
from elastic.rendezvous.rounds import Slot
from tests.fakes.ring import real_ring

ME = "hostA-1-aaaaaa.w0"  # the writing worker
OTHERS = ("hostB-2-bbbbbb.w0", "hostC-3-cccccc.w0")


def _plan(number: int, workers, *, lost=()) -> RoundPlan:
    slots = tuple(Slot(w.split(".")[0], w) for w in workers)
    return RoundPlan(round=number, slots=slots, hosts={s.member_id: (s.member_id, "10.0.0.1") for s in slots},
                     store_addr="10.0.0.1:1", created=time.time(), lost=tuple(lost))


class Job:
    """Writes a job's plans and status the way the coordinator does."""

    def __init__(self, etcd: Etcd, job_id: str):
        self.etcd, self.keys = etcd, JobKeys(job_id)

    def form(self, number: int, workers, *, lost=()) -> None:
        body = _plan(number, workers, lost=lost).to_json()
        stale = [Delete(self.keys.round(number - KEEP_ROUNDS))] if number > KEEP_ROUNDS else []
        self.etcd.txn([], [Put(self.keys.plan, body), Put(self.keys.round(number), body), *stale])

    def end(self, state: str) -> None:
        self.etcd.put(self.keys.status, JobStatus(state, "test").to_json())


def _ring_check(etcd: Etcd, job_id: str, round_number: int):
    """What ``Ring.publish_check`` hands the writer in ``round_number`` (the rank 0 is ME)."""
    config = WorkerConfig(job_id=job_id, endpoints="", worker_id=ME, member_id=ME.split(".")[0], host_id="hostA",
                          round=round_number)
    ring = real_ring(round_plan=_plan(round_number, (ME, *OTHERS)), config=config, etcd=etcd)
    return ring.publish_check()


def _check(etcd: Etcd, job_id: str, round_number: int):
    """The publish check a rank 0 in ``round_number`` hands to its checkpoint writer, as a
    function returning None (publish) or the reason the writer would log."""
    still_current = _ring_check(etcd, job_id, round_number)

    def refusal():
        try:
            assert still_current() is True
            return None
        except PublishRefusal as exc:
            return str(exc)

    return refusal


@pytest.fixture
def job(etcd, job_id) -> Job:
    yield Job(etcd, job_id)
    for kv in etcd.get_prefix(JobKeys(job_id).prefix)[0]:
        etcd.delete(kv.key)


def test_a_write_of_the_current_round_is_published(etcd, job_id, job):
    job.form(1, (ME, *OTHERS))
    assert _check(etcd, job_id, 1)() is None


def test_a_write_is_refused_once_the_plan_moved_on_without_the_worker(etcd, job_id, job):
    job.form(3, (ME, *OTHERS))
    refusal = _check(etcd, job_id, 3)
    job.form(4, OTHERS, lost=(ME,))
    assert "declared this worker lost" in refusal()


def test_a_write_is_published_when_newer_join_rounds_still_include_the_worker(etcd, job_id, job):
    job.form(3, (ME, OTHERS[0]))
    refusal = _check(etcd, job_id, 3)
    job.form(4, (ME, *OTHERS))  # a host joined: the ring switched at a commit, nothing rolled back
    job.form(5, (ME, *OTHERS))  # a reset round with everybody (a broken ring, nobody lost)
    assert refusal() is None


def test_a_write_is_refused_after_the_worker_was_lost_and_admitted_again(etcd, job_id, job):
    # Rank 0's host is cut: round 4 goes on without it; the link returns, its agent
    # registers again with the same worker, and round 5 admits it. Its write of round 3,
    # held up meanwhile, would shadow what the survivors wrote since.
    job.form(3, (ME, *OTHERS))
    refusal = _check(etcd, job_id, 3)
    job.form(4, OTHERS, lost=(ME,))
    job.form(5, (*OTHERS, ME))
    assert refusal() == "its round 3 is over: round 4 declared this worker lost"


def test_a_write_is_refused_after_the_worker_left_a_round_and_came_back(etcd, job_id, job):
    job.form(3, (ME, *OTHERS))
    refusal = _check(etcd, job_id, 3)
    job.form(4, OTHERS)  # withdrawn (a graceful leave): not lost, but not a member either
    job.form(5, (*OTHERS, ME))
    assert refusal() == "its round 3 is over: round 4 went on without this worker"


def test_a_write_is_refused_when_the_rounds_since_are_no_longer_kept(etcd, job_id, job):
    job.form(3, (ME, *OTHERS))
    refusal = _check(etcd, job_id, 3)
    for number in range(4, 5 + KEEP_ROUNDS):  # round 4 and a few after it are pruned
        job.form(number, (ME, *OTHERS))
    assert "round 4 is no longer kept" in refusal()  # nothing proves it was a member of round 4


def test_a_write_is_refused_when_the_job_failed(etcd, job_id, job):
    job.form(2, (ME, *OTHERS))
    refusal = _check(etcd, job_id, 2)
    job.end(FAILED)
    assert refusal() == "the job failed"


def test_a_write_of_an_ended_job_that_succeeded_is_published(etcd, job_id, job):
    # The final checkpoint of a job that succeeded is written after the status says so.
    job.form(2, (ME, *OTHERS))
    job.end(SUCCEEDED)
    assert _check(etcd, job_id, 2)() is None


def test_a_write_is_refused_when_etcd_holds_no_plan_of_the_job(etcd, job_id, job):
    assert "no plan" in _check(etcd, job_id, 2)()  # the job's keys are gone: nothing proves it current


def test_a_write_is_refused_when_etcd_cannot_be_reached(job_id):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    unreachable = Etcd(EtcdConfig.from_string(f"127.0.0.1:{port}", call_timeout=0.5, retry_deadline=1.0))
    try:
        started = time.monotonic()
        assert "etcd unreachable" in _check(unreachable, job_id, 2)()
        assert time.monotonic() - started < 10
    finally:
        unreachable.close()


def test_the_writer_refuses_a_stale_write_and_says_why_in_one_line(etcd, job_id, job, tmp_path, caplog):
    job.form(3, (ME, *OTHERS))
    writer = DurableWriter(CheckpointPolicy(str(tmp_path)))
    assert writer.submit({"w": torch.zeros(4)}, step=7, round=3, still_current=_ring_check(etcd, job_id, 3))
    assert writer.flush(30) and writer.last_error is None  # round 3 is current: published
    job.form(4, OTHERS, lost=(ME,))
    job.form(5, (*OTHERS, ME))
    with caplog.at_level("WARNING"):
        assert writer.submit({"w": torch.ones(4)}, step=8, round=3, still_current=_ring_check(etcd, job_id, 3))
        assert writer.flush(30)
    assert [i.step for i in list_checkpoints(str(tmp_path)) if i.valid] == [7]
    lines = [r.getMessage() for r in caplog.records if "not published" in r.getMessage()]
    assert lines == ["checkpoint of step 8 not published: its round 3 is over: round 4 declared this worker lost"]
