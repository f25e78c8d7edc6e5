"""Session (lease + keep-alive) against a real etcd, including etcd SIGKILL and restart."""

from __future__ import annotations

import threading
import time

import pytest

from elastic.rendezvous.errors import ConfigError
from elastic.rendezvous.etcd import Etcd
from elastic.rendezvous.session import Session
from tests.fakes.waiting import holds
from tests.fakes.waiting import poll as wait_until

pytestmark = pytest.mark.timeout(30)


def test_close_revokes_the_lease_at_once(etcd, job_prefix, no_leaked_threads):
    with Session(etcd, 10, name="closing") as session:
        etcd.put(job_prefix + "member", b"x", lease=session.lease_id)
        assert etcd.get(job_prefix + "member").lease == session.lease_id
    assert etcd.get(job_prefix + "member") is None
    assert not session.alive and not session.lost.is_set()


def test_keep_alive_holds_the_key_beyond_the_ttl(etcd, job_prefix, no_leaked_threads):
    with Session(etcd, 1, name="alive") as session:
        lease = session.lease_id
        etcd.put(job_prefix + "member", b"x", lease=session.lease_id)
        # The property under test is "still there after 2.5 TTLs": checked all along.
        assert holds(lambda: etcd.get(job_prefix + "member") is not None and not session.lost.is_set(), 2.5)
        assert session.lease_id == lease and etcd.lease_time_to_live(lease) >= 0  # -1: gone


def test_orphaned_key_vanishes_within_ttl_plus_one_second(etcd, job_prefix, no_leaked_threads):
    session = Session(etcd, 1, name="orphan")
    etcd.put(job_prefix + "member", b"x", lease=session.lease_id)
    session.orphan()
    orphaned = time.monotonic()
    assert not session.alive
    assert wait_until(lambda: etcd.get(job_prefix + "member") is None, timeout=5.0)
    # TTL + 1 s (etcd checks expiry every 0.5 s), plus slack for a loaded machine: still well
    # short of what a key kept alive by a forgotten keep-alive would show (never gone).
    assert time.monotonic() - orphaned <= 2.0 + 1.0


def test_lease_revoked_behind_our_back_is_replaced_and_owner_re_registers(etcd, job_prefix, no_leaked_threads):
    key = job_prefix + "member"
    new_leases = []
    re_registered = threading.Event()

    def on_new_lease(lease_id: int) -> None:
        etcd.put(key, b"again", lease=lease_id)
        new_leases.append(lease_id)
        re_registered.set()

    with Session(etcd, 1, on_new_lease=on_new_lease, name="replaced") as session:
        old = session.lease_id
        etcd.put(key, b"first", lease=old)
        etcd.revoke_lease(old)  # as if etcd had expired it
        assert re_registered.wait(5)
        assert new_leases == [session.lease_id] and session.lease_id != old and session.renewals == 1
        kv = etcd.get(key)
        assert (kv.value, kv.lease) == (b"again", session.lease_id)
        assert not session.lost.is_set()


def test_lost_is_set_when_the_lease_cannot_be_re_established(etcd, no_leaked_threads):
    def failing_owner(lease_id: int) -> None:
        raise RuntimeError("cannot re-register")

    session = Session(etcd, 1, on_new_lease=failing_owner, name="doomed")
    etcd.revoke_lease(session.lease_id)
    assert session.lost.wait(6)
    assert "could not re-establish lease" in session.lost_reason
    assert "cannot re-register" in session.lost_reason
    assert session.alive  # a lost session keeps trying (a partition heals)
    session.close()
    assert not session.alive


def test_invalid_ttl_is_rejected(etcd):
    with pytest.raises(ConfigError, match="invalid session ttl 0"):
        Session(etcd, 0)


def test_session_rides_out_etcd_sigkill_and_restart(fresh_etcd, job_prefix, no_leaked_threads):
    """Per DESIGN.md leases survive a restart on the same data dir; the keep-alive must reconnect."""
    client = Etcd(fresh_etcd.config())
    session = Session(client, 2, name="survivor")
    lease = session.lease_id
    client.put(job_prefix + "member", b"x", lease=lease)

    attempts = client.requests
    fresh_etcd.kill()
    # etcd is away until the keep-alive has failed against it (at least two attempts).
    assert wait_until(lambda: client.requests >= attempts + 2, 5), "the keep-alive never tried"
    fresh_etcd.restart()

    # For 1.5 TTLs after the restart (well past the TTL), the same lease holds the key.
    def held() -> bool:
        kv = client.get(job_prefix + "member")
        return kv is not None and kv.lease == lease and not session.lost.is_set()

    assert holds(held, 3.0)
    assert session.lease_id == lease and not session.lost.is_set()
    assert client.lease_time_to_live(lease) > 0
    session.close()
    assert client.get(job_prefix + "member") is None
    client.close()


def test_session_declares_loss_when_etcd_stays_away(fresh_etcd, no_leaked_threads):
    client = Etcd(fresh_etcd.config(retry_deadline=1.0, call_timeout=0.5))
    session = Session(client, 1, name="stranded")
    fresh_etcd.kill()
    started = time.monotonic()
    assert session.lost.wait(8)
    # Lost after max(ttl, retry_deadline) of failures, plus one refresh period.
    assert time.monotonic() - started < 4.0
    assert "could not refresh lease" in session.lost_reason
    assert "cannot reach etcd" in session.lost_reason
    session.orphan()
    client.close()


def test_a_lost_session_comes_back_with_a_new_lease_when_etcd_does(fresh_etcd, job_prefix, no_leaked_threads):
    client = Etcd(fresh_etcd.config(retry_deadline=1.0, call_timeout=0.5))
    client.check()
    registered = threading.Event()
    leases = []

    def owner(lease_id: int) -> None:
        client.put(job_prefix + "member", b"back", lease=lease_id)
        leases.append(lease_id)
        registered.set()

    session = Session(client, 1, on_new_lease=owner, name="cut-off")
    old = session.lease_id
    fresh_etcd.kill()
    assert session.lost.wait(8)
    fresh_etcd.restart()
    assert registered.wait(15), "the session did not register again once etcd was back"
    assert wait_until(lambda: not session.lost.is_set(), 5)
    assert session.restored == 1 and session.lease_id == leases[-1] != old
    assert client.get(job_prefix + "member").lease == session.lease_id
    session.close()
    client.close()


def test_a_session_back_on_a_new_lease_revokes_the_one_it_gave_up(fresh_etcd, job_prefix, no_leaked_threads):
    """etcd extends every lease when it restarts, so the lease we declared lost may still
    be alive, holding the keys we put on it (an agent's coordinator election key: nobody,
    not even we, could lead until it expired, a whole TTL after etcd returned)."""
    client = Etcd(fresh_etcd.config(retry_deadline=1.0, call_timeout=0.5))
    session = Session(client, 3, name="gave-up", on_new_lease=lambda lease: None)
    old = session.lease_id
    client.put(job_prefix + "election", b"me", lease=old)
    fresh_etcd.kill()
    assert session.lost.wait(10)
    fresh_etcd.restart()
    assert wait_until(lambda: not session.lost.is_set(), 15), "the session did not come back"
    assert session.lease_id != old
    # Gone at once, not when its extended TTL (3 s) runs out.
    assert wait_until(lambda: client.get(job_prefix + "election") is None, 1.0), "the old lease still holds its keys"
    assert client.lease_time_to_live(old) < 0
    session.close()
    client.close()
