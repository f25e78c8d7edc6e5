"""The etcd client against a real etcd: KV, txn races, leases, watches, unreachable endpoints."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from etcd3 import etcdrpc

from elastic.rendezvous.errors import LeaseLostError, RendezvousConnectionError, RendezvousError
from elastic.rendezvous.etcd import (
    CreateRevisionEquals,
    Delete,
    Etcd,
    EtcdConfig,
    ModRevisionEquals,
    Put,
)
from tests.fakes.waiting import poll as wait_until

pytestmark = pytest.mark.timeout(30)


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]




# ----------------------------------------------------------------------------- KV and txn


def test_put_get_prefix_delete(etcd, job_prefix):
    first = etcd.put(job_prefix + "b", b"2")
    second = etcd.put(job_prefix + "a", b"1")
    etcd.put(job_prefix.rstrip("/") + "-sibling", b"not under the prefix")
    assert second > first

    kv = etcd.get(job_prefix + "a")
    assert (kv.key, kv.value, kv.mod_revision, kv.version, kv.lease) == (job_prefix + "a", b"1", second, 1, 0)
    assert etcd.get(job_prefix + "missing") is None

    kvs, revision = etcd.get_prefix(job_prefix)
    assert [kv.key for kv in kvs] == [job_prefix + "a", job_prefix + "b"]  # sorted by key
    assert revision >= second

    assert etcd.delete(job_prefix + "a") is True
    assert etcd.delete(job_prefix + "a") is False
    assert etcd.get(job_prefix.rstrip("/") + "-sibling") is not None


def test_txn_comparisons_choose_the_branch(etcd, job_prefix):
    key = job_prefix + "k"
    won, rev = etcd.txn([CreateRevisionEquals(key, 0)], [Put(key, b"v1")], [Put(key + "-lost", b"x")])
    assert won and etcd.get(key).mod_revision == rev
    won, _ = etcd.txn([CreateRevisionEquals(key, 0)], [Put(key, b"v2")], [Put(key + "-lost", b"x")])
    assert not won and etcd.get(key).value == b"v1" and etcd.get(key + "-lost") is not None

    current = etcd.get(key).mod_revision
    assert not etcd.txn([ModRevisionEquals(key, current - 1)], [Delete(key)])[0]
    assert etcd.txn([ModRevisionEquals(key, current)], [Delete(key)])[0]
    assert etcd.get(key) is None


def test_racing_create_if_absent_has_exactly_one_winner(etcd_server, job_prefix):
    """Two clients (own channels) race the same create-if-absent txn, 30 times."""
    clients = [Etcd(etcd_server.config()), Etcd(etcd_server.config())]
    rounds = 30
    barrier = threading.Barrier(len(clients), timeout=10)
    wins = [[False] * rounds for _ in clients]
    errors = []

    def racer(index: int) -> None:
        try:
            for r in range(rounds):
                key = f"{job_prefix}round/{r}"
                barrier.wait()
                won, _ = clients[index].txn([CreateRevisionEquals(key, 0)], [Put(key, str(index).encode())])
                wins[index][r] = won
        except Exception as exc:  # reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for client in clients:
        client.close()
    assert not [t for t in threads if t.is_alive()], "a racer is still running after 20 s"
    assert not errors
    for r in range(rounds):
        winners = [i for i in range(len(clients)) if wins[i][r]]
        assert len(winners) == 1, f"round {r}: winners {winners}"
    with Etcd(etcd_server.config()) as reader:
        kvs, _ = reader.get_prefix(job_prefix + "round/")
    assert {kv.key: int(kv.value) for kv in kvs} == {
        f"{job_prefix}round/{r}": next(i for i in range(len(clients)) if wins[i][r]) for r in range(rounds)
    }


def test_requests_are_counted(etcd, job_prefix):
    before = etcd.requests
    etcd.put(job_prefix + "x", b"1")
    etcd.get(job_prefix + "x")
    assert etcd.requests == before + 2


# ----------------------------------------------------------------------------- leases


def test_lease_key_vanishes_at_once_on_revoke(etcd, job_prefix):
    lease = etcd.grant_lease(30)
    etcd.put(job_prefix + "owned", b"x", lease=lease)
    assert etcd.get(job_prefix + "owned").lease == lease
    assert 0 < etcd.refresh_lease(lease) <= 30
    etcd.revoke_lease(lease)
    assert etcd.get(job_prefix + "owned") is None
    etcd.revoke_lease(lease)  # already gone: fine
    with pytest.raises(LeaseLostError, match=f"lease {lease:x} expired or was revoked"):
        etcd.refresh_lease(lease)


def test_lease_ttl_is_rounded_up_to_whole_seconds(etcd):
    lease = etcd.grant_lease(1.2)
    try:
        assert etcd.refresh_lease(lease) == 2.0
    finally:
        etcd.revoke_lease(lease)


# ----------------------------------------------------------------------------- unreachable etcd


def test_check_of_unreachable_endpoint_fails_fast_with_one_line():
    port = closed_port()
    with Etcd(EtcdConfig.from_string(f"127.0.0.1:{port}")) as client:
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as info:
            client.check(timeout=3.0)
        elapsed = time.monotonic() - started
    message = str(info.value)
    assert elapsed < 5.0
    assert message.startswith(f"cannot reach etcd at 127.0.0.1:{port} within 3s: ")
    assert "\n" not in message and len(message) < 200


def test_call_gives_up_after_retry_deadline():
    with Etcd(EtcdConfig.from_string(f"127.0.0.1:{closed_port()}", retry_deadline=1.0, call_timeout=0.5)) as client:
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="within 1s"):
            client.put("/x", b"1")
        assert time.monotonic() - started < 2.5
        assert client.requests > 2  # it did retry


def test_fails_over_to_the_next_endpoint(etcd_server, job_prefix):
    config = EtcdConfig(endpoints=(("127.0.0.1", closed_port()), ("127.0.0.1", etcd_server.client_port)),
                        retry_deadline=5.0)
    with Etcd(config) as client:
        started = time.monotonic()
        client.put(job_prefix + "k", b"v")
        assert client.get(job_prefix + "k").value == b"v"
        assert time.monotonic() - started < 3.0


def test_close_ends_a_retrying_call_promptly():
    client = Etcd(EtcdConfig.from_string(f"127.0.0.1:{closed_port()}", retry_deadline=20.0, call_timeout=0.5))
    errors = []

    def call():
        try:
            client.get("/x")
        except RendezvousError as exc:
            errors.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    # In the retry loop: its first attempts have been refused, it sleeps until the next one.
    assert wait_until(lambda: client.requests >= 2, 10), "the call never started retrying"
    started = time.monotonic()
    client.close()
    caller.join(5)
    assert not caller.is_alive() and time.monotonic() - started < 2.0
    assert "closed" in str(errors[0])


# ----------------------------------------------------------------------------- watches


def test_watch_delivers_events_in_order(etcd, job_prefix, no_leaked_threads):
    received = []
    done = threading.Event()

    def on_events(events):
        received.extend(events)
        if any(e.kv.key.endswith("/end") for e in events):
            done.set()

    watch = etcd.watch(job_prefix, prefix=True, start_revision=etcd.current_revision() + 1, on_events=on_events)
    expected = []
    for i in range(20):
        etcd.put(f"{job_prefix}k{i % 5}", str(i).encode())
        expected.append(("put", f"{job_prefix}k{i % 5}", str(i).encode()))
    etcd.delete(job_prefix + "k0")
    expected.append(("delete", job_prefix + "k0", b""))
    etcd.put(job_prefix + "end", b"")
    expected.append(("put", job_prefix + "end", b""))
    etcd.put(job_prefix.rstrip("/") + "-other", b"outside the prefix")

    assert done.wait(10)
    watch.cancel()
    assert [(e.type, e.kv.key, e.kv.value) for e in received] == expected
    revisions = [e.kv.mod_revision for e in received]
    assert revisions == sorted(revisions) and watch.revision == revisions[-1]


def test_watch_replays_from_a_past_revision_and_single_key(etcd, job_prefix, no_leaked_threads):
    first = etcd.put(job_prefix + "a", b"1")
    etcd.put(job_prefix + "ab", b"not this key")
    etcd.put(job_prefix + "a", b"2")
    got = []
    two = threading.Event()

    def on_events(events):
        got.extend(e.kv.value for e in events)
        if len(got) >= 2:
            two.set()

    with etcd.watch(job_prefix + "a", prefix=False, start_revision=first, on_events=on_events):
        assert two.wait(10)
    assert got == [b"1", b"2"]


def test_watch_survives_a_failing_callback(etcd, job_prefix, no_leaked_threads):
    calls = []
    second = threading.Event()

    def on_events(events):
        calls.append(events[0].kv.value)
        if len(calls) == 1:
            raise RuntimeError("owner bug")
        second.set()

    watch = etcd.watch(job_prefix, prefix=True, start_revision=0, on_events=on_events)
    assert watch.ready.wait(10)
    etcd.put(job_prefix + "x", b"1")
    assert wait_until(lambda: calls, 10)
    etcd.put(job_prefix + "x", b"2")
    assert second.wait(10)
    assert watch.active
    watch.cancel()
    assert calls == [b"1", b"2"]


def test_watch_of_compacted_history_resets_then_continues(etcd, job_prefix, no_leaked_threads):
    start = etcd.put(job_prefix + "k", b"old")
    etcd.put(job_prefix + "k", b"newer")
    compact_to = etcd.put(job_prefix + "k", b"newest")
    _, channel = etcd._channel()
    etcdrpc.KVStub(channel).Compact(etcdrpc.CompactionRequest(revision=compact_to, physical=True), timeout=5)

    resets = threading.Event()
    later = threading.Event()
    values = []

    def on_reset():
        kvs, revision = etcd.get_prefix(job_prefix)
        values.extend(kv.value for kv in kvs)  # the owner's re-read state
        resets.set()
        return revision

    def on_events(events):
        values.extend(e.kv.value for e in events)
        later.set()

    watch = etcd.watch(job_prefix, prefix=True, start_revision=start, on_events=on_events, on_reset=on_reset)
    assert resets.wait(10)
    etcd.put(job_prefix + "k", b"after reset")
    assert later.wait(10)
    watch.cancel()
    assert values == [b"newest", b"after reset"]


def test_cancel_is_prompt_and_close_cancels_watches(etcd_server, job_prefix, no_leaked_threads):
    client = Etcd(etcd_server.config())
    first = client.watch(job_prefix, prefix=True, start_revision=0, on_events=lambda events: None)
    second = client.watch(job_prefix + "x", prefix=False, start_revision=0, on_events=lambda events: None)
    assert first.ready.wait(10) and second.ready.wait(10)
    started = time.monotonic()
    first.cancel()
    assert not first.active and time.monotonic() - started < 1.0
    client.close()
    assert not second.active


def test_watch_survives_etcd_sigkill_and_restart(fresh_etcd, job_prefix, no_leaked_threads):
    client = Etcd(fresh_etcd.config())
    received = []
    after_restart = threading.Event()

    def on_events(events):
        received.extend((e.type, e.kv.value) for e in events)
        if any(e.kv.value == b"after-2" for e in events):
            after_restart.set()

    watch = client.watch(job_prefix, prefix=True, start_revision=0, on_events=on_events)
    assert watch.ready.wait(10)
    client.put(job_prefix + "k", b"before")
    assert wait_until(lambda: received, 10)

    fresh_etcd.kill()
    fresh_etcd.restart()
    # Written by another client right away, likely before the watch has reconnected:
    # resuming from the last seen revision must still deliver them, once each.
    with Etcd(fresh_etcd.config()) as writer:
        writer.put(job_prefix + "k", b"after-1")
        writer.delete(job_prefix + "k")
        writer.put(job_prefix + "k", b"after-2")

    assert after_restart.wait(10)
    assert received == [("put", b"before"), ("put", b"after-1"), ("delete", b""), ("put", b"after-2")]
    assert watch.reconnects >= 1
    client.close()
    assert not watch.active
