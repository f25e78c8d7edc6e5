"""The coordinator against real etcd: watches that lose history, fenced status writes
(issue 12, item 6).

Faults are injected at the exact point: a watch stream is cut and kept from
reconnecting while etcd compacts past it; a status read is answered, then another
writer goes first.
"""

from __future__ import annotations

import json
import threading

import pytest

from elastic.rendezvous import (
    FAILED,
    SUCCEEDED,
    Coordinator,
    ControlChannel,
    Etcd,
    JobKeys,
    JobStatus,
    Member,
    RendezvousSettings,
    Session,
)
from elastic.rendezvous.control import STOPPING
from elastic.rendezvous.etcd import CreateRevisionEquals, Put
from tests.fakes.waiting import poll
from tests.fakes.local_members import has_workers, worker

pytestmark = pytest.mark.timeout(90)


def compact(etcd: Etcd) -> int:
    from etcd3 import etcdrpc

    revision = etcd.current_revision()
    _, channel = etcd._channel()
    etcdrpc.KVStub(channel).Compact(etcdrpc.CompactionRequest(revision=revision, physical=True), timeout=10)
    return revision


def status_in(etcd: Etcd, keys: JobKeys) -> dict | None:
    kv = etcd.get(keys.status)
    # "since" (when it was written) is for people; the tests compare what was decided.
    return None if kv is None else {k: v for k, v in json.loads(kv.value).items() if k != "since"}


def cut_watch(participant, key: str) -> threading.Event:
    """Cut ``participant``'s watch on ``key`` and keep it from reconnecting until the
    returned event is set (fault injection at the exact point)."""
    watch = next(w for w in list(participant.etcd._watches) if w.key == key and w.active)
    gate = threading.Event()
    real_channel = participant.etcd._channel

    def channel():
        if threading.current_thread().name == f"etcd-watch:{key}":
            assert gate.wait(30)
        return real_channel()

    participant.etcd._channel = channel
    with watch._lock:
        watch._call.cancel()
    assert poll(lambda: watch._call is None, timeout=10)
    return gate


def test_a_member_deleted_while_the_members_watch_was_compacted_away_is_still_seen(local, etcd):
    settings = RendezvousSettings(1, 8, settle=0.2, timeout=60)
    for name in ("a", "b", "c"):
        local.add(name, settings)
    first = local.wait_for_plan("a", has_workers(*(worker(m) for m in ("a", "b", "c"))))
    leader = poll(local.leader, timeout=10)
    assert leader is not None and leader is local.by_id["a"]  # the first to start leads
    gate = cut_watch(leader, local.keys.members)

    local.leave("c")  # c's member key is deleted while nobody watches...
    compact(etcd)  # ...and the history holding that delete is gone
    gate.set()
    after = local.wait_for_plan("a", lambda p: p.round > first.round, timeout=20)
    assert after.worker_ids() == (worker("a"), worker("b"))


def test_a_reset_request_put_while_the_requests_watch_was_compacted_away_is_still_answered(local, etcd):
    # One member: a reset request then makes the coordinator probe no other agent (these
    # in-process members serve no agent port, so any other would count as dead).
    local.add("a", RendezvousSettings(1, 8, settle=0.2, timeout=60))
    first = local.wait_for_plan("a", has_workers(worker("a")))
    leader = poll(local.leader, timeout=10)
    assert leader is not None
    gate = cut_watch(leader, local.keys.requests)

    # A worker whose ring broke asks for a new round while nobody watches...
    body = json.dumps({"round": first.round, "reason": "ring broken", "lost": []}).encode()
    etcd.put(local.keys.request(worker("a")), body)
    compact(etcd)  # ...and the history holding that put is gone
    gate.set()
    after = local.wait_for_plan("a", lambda p: p.round > first.round, timeout=20)
    assert after.reason == "reset requested: ring broken" and after.worker_ids() == (worker("a"),), after
    assert poll(lambda: etcd.get(local.keys.request(worker("a"))) is None, timeout=10), "the request was not answered"


def test_a_success_never_overwrites_a_failure_written_between_read_and_write(etcd, job_id):
    keys = JobKeys(job_id)
    etcd.put(keys.status, JobStatus(STOPPING, "scale-down").to_json())  # not over: may be replaced
    failing = ControlChannel(etcd, keys)
    racing_client = Etcd(etcd.config)
    try:
        racing = ControlChannel(racing_client, keys)
        real_get = racing_client.get

        def get_then_lose_the_race(key):
            kv = real_get(key)
            if key == keys.status and not failing_wrote.is_set():
                failing.set_status(JobStatus(FAILED, "user error"))  # lands between our read and write
                failing_wrote.set()
            return kv

        failing_wrote = threading.Event()
        racing_client.get = get_then_lose_the_race
        assert racing.set_status(JobStatus(SUCCEEDED, "worker finished")) is False
        assert failing_wrote.is_set()
        assert status_in(etcd, keys) == {"state": FAILED, "reason": "user error"}
    finally:
        racing_client.close()


@pytest.mark.parametrize("first,second", [(FAILED, SUCCEEDED), (SUCCEEDED, FAILED), (FAILED, FAILED)])
def test_a_terminal_status_is_never_overwritten(etcd, job_id, first, second):
    keys = JobKeys(job_id)
    control = ControlChannel(etcd, keys)
    assert control.set_status(JobStatus(first, "first")) is True
    assert control.set_status(JobStatus(second, "second")) is False
    assert status_in(etcd, keys) == {"state": first, "reason": "first"}


def test_a_deposed_coordinator_cannot_fail_the_job(etcd, job_id):
    keys = JobKeys(job_id)
    old, new = Session(etcd, 5, name="old"), Session(etcd, 5, name="new")
    control = ControlChannel(etcd, keys).start()
    try:
        won, _ = etcd.txn([CreateRevisionEquals(keys.coordinator, 0)],
                          [Put(keys.coordinator, b"old", lease=old.lease_id)])
        assert won
        stale_token = etcd.get(keys.coordinator).create_revision
        old.close()  # its lease (and the election key) is gone; the old object does not know
        etcd.put(keys.coordinator, b"new", lease=new.lease_id)
        now = [1000.0]
        settings = RendezvousSettings(2, 4, settle=0.1, timeout=10)
        coordinator = Coordinator(etcd, keys, old, settings, "old", control, clock=lambda: now[0])
        coordinator._members = {"old": Member("old", "h", "10.0.0.1", 1, ("old/w0",), 0.0, revision=1)}
        coordinator._below_min_since = now[0] - 60  # below min_np for longer than the timeout: Fail
        coordinator._step(stale_token)
        assert etcd.get(keys.status) is None  # the deposed coordinator's decision was refused
        # The same decision by the coordinator in office is written.
        token = etcd.get(keys.coordinator).create_revision
        coordinator._step(token)
        assert status_in(etcd, keys)["state"] == FAILED
    finally:
        control.close()
        new.close()


def test_a_leader_whose_election_delete_was_compacted_away_steps_down(local, etcd):
    settings = RendezvousSettings(1, 8, settle=0.2, timeout=60)
    for name in ("a", "b"):
        local.add(name, settings)
    local.wait_for_plan("a", has_workers(worker("a"), worker("b")))
    leader = poll(local.leader, timeout=10)
    assert leader is not None and leader is local.by_id["a"]
    key = local.keys.coordinator
    gate = cut_watch(leader, key)  # the election watch

    # The election key goes (as when a's lease is lost) and b takes it, while a cannot
    # see it; then the history holding that delete is compacted away.
    etcd.delete(key)
    assert poll(lambda: local.by_id["b"].coordinator.leading.is_set(), timeout=20), "b never took the election"
    compact(etcd)
    gate.set()
    # a must learn from a fresh read that the key is no longer its own: one leader again.
    assert poll(lambda: not leader.coordinator.leading.is_set(), timeout=20), "a still leads beside b"
    assert local.leader() is local.by_id["b"]
