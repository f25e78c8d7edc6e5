"""HealthState verdicts (with an injected clock) and HealthServer over real HTTP."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from elastic.agent.health import HealthServer, HealthState, SessionWatch


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of GET http://127.0.0.1:port/path, without raising on 4xx/5xx."""
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read().decode()


# --- HealthState -------------------------------------------------------------------


def test_state_is_unhealthy_until_registered():
    state = HealthState(ttl=10, clock=FakeClock())
    assert state.probe() == (False, "not registered yet")
    state.mark_registered()
    healthy, detail = state.probe()
    assert healthy and "session ok" in detail


def test_state_tolerates_a_session_loss_shorter_than_the_ttl():
    clock = FakeClock()
    state = HealthState(ttl=10, clock=clock)
    state.mark_registered()
    state.mark_session_lost(since=clock.now)
    clock.now += 9.9
    healthy, detail = state.probe()
    assert healthy
    assert "within ttl 10s" in detail


def test_state_fails_once_the_session_is_lost_longer_than_the_ttl():
    clock = FakeClock()
    state = HealthState(ttl=10, clock=clock)
    state.mark_registered()
    state.mark_session_lost(since=clock.now)
    clock.now += 12.3
    assert state.probe() == (False, "etcd session lost for 12.3s (ttl 10s)")


def test_state_recovers_when_the_session_is_ok_again():
    clock = FakeClock()
    state = HealthState(ttl=10, clock=clock)
    state.mark_registered()
    state.mark_session_lost(since=clock.now - 60)
    assert state.probe()[0] is False
    state.mark_session_ok()
    assert state.probe() == (True, "registered, etcd session ok")


def test_repeated_loss_reports_keep_the_start_of_the_outage():
    clock = FakeClock()
    state = HealthState(ttl=10, clock=clock)
    state.mark_registered()
    state.mark_session_lost(since=clock.now - 11)
    state.mark_session_lost(since=clock.now - 1)  # a later retry failing again
    assert state.probe() == (False, "etcd session lost for 11.0s (ttl 10s)")


def test_a_lost_session_before_registration_still_reads_not_registered():
    clock = FakeClock()
    state = HealthState(ttl=5, clock=clock)
    state.mark_session_lost(since=clock.now - 100)
    assert state.probe() == (False, "not registered yet")


@pytest.mark.parametrize("ttl", [0, -1.5])
def test_state_rejects_a_non_positive_ttl(ttl):
    with pytest.raises(ValueError, match="ttl must be > 0"):
        HealthState(ttl=ttl)


def test_state_uses_the_monotonic_clock_by_default():
    state = HealthState(ttl=0.5)
    state.mark_registered()
    state.mark_session_lost(since=time.monotonic() - 1.0)
    healthy, detail = state.probe()
    assert not healthy and detail.startswith("etcd session lost for 1.")


# --- HealthServer ------------------------------------------------------------------


@pytest.fixture
def verdict():
    """A mutable verdict the served probe reads, so tests can flip it."""
    return {"value": (True, "fine")}


@pytest.fixture
def server(verdict):
    srv = HealthServer(port=0, probe=lambda: verdict["value"], host="127.0.0.1").start()
    yield srv
    srv.stop()


def test_server_binds_a_real_port_when_given_zero(server):
    assert server.port > 0


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/healthz?verbose=1"])
def test_server_answers_200_with_the_detail_when_healthy(server, path):
    assert get(server.port, path) == (200, "ok: fine\n")


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_server_answers_503_with_the_detail_when_unhealthy(server, verdict, path):
    verdict["value"] = (False, "etcd session lost for 12.3s (ttl 10s)")
    assert get(server.port, path) == (503, "etcd session lost for 12.3s (ttl 10s)\n")


def test_server_answers_404_for_other_paths(server):
    status, body = get(server.port, "/metrics")
    assert status == 404 and "/healthz" in body


def test_server_answers_503_when_the_probe_raises():
    def broken() -> tuple[bool, str]:
        raise RuntimeError("agent state unreadable")

    with HealthServer(port=0, probe=broken, host="127.0.0.1") as srv:
        status, body = get(srv.port, "/healthz")
    assert status == 503
    assert body == "probe failed: RuntimeError: agent state unreadable\n"


def test_server_follows_a_health_state_through_registration_and_loss():
    clock = FakeClock()
    state = HealthState(ttl=10, clock=clock)
    with HealthServer(port=0, probe=state.probe, host="127.0.0.1") as srv:
        assert get(srv.port, "/readyz") == (503, "not registered yet\n")
        state.mark_registered()
        assert get(srv.port, "/readyz")[0] == 200
        state.mark_session_lost(since=clock.now)
        clock.now += 30
        assert get(srv.port, "/healthz") == (503, "etcd session lost for 30.0s (ttl 10s)\n")


def test_stop_closes_the_port_and_ends_the_thread():
    threads_before = set(threading.enumerate())
    srv = HealthServer(port=0, probe=lambda: (True, "x"), host="127.0.0.1").start()
    port = srv.port
    assert get(port, "/healthz")[0] == 200
    srv.stop()
    srv.stop()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    leaked = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert leaked == []


def test_stop_waits_for_requests_in_flight_and_cuts_off_a_silent_prober():
    threads_before = set(threading.enumerate())
    srv = HealthServer(port=0, probe=lambda: (True, "x"), host="127.0.0.1", request_timeout=0.5).start()
    silent = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    silent.sendall(b"GET /healthz HTTP/1.1\r\n")  # ... and never the rest of the request
    for _ in range(20):  # answered requests' threads end as they close their connections
        assert get(srv.port, "/healthz")[0] == 200
    started = time.monotonic()
    srv.stop()
    assert time.monotonic() - started < 3.0  # the silent prober's timeout, not forever
    leaked = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    silent.close()
    assert leaked == []


def test_start_twice_is_an_error(server):
    with pytest.raises(RuntimeError, match="already started"):
        server.start()


@pytest.mark.parametrize("port", [-1, 65536])
def test_server_rejects_an_invalid_port(port):
    with pytest.raises(ValueError, match="health port"):
        HealthServer(port=port, probe=lambda: (True, ""))


def test_session_watch_reports_a_loss_once_and_the_return_once():
    class Session:
        def __init__(self):
            self.lost, self.lost_reason = threading.Event(), "lease expired"

    state, events, session = HealthState(ttl=10), [], Session()
    state.mark_registered()
    watch = SessionWatch(state, lambda name, **fields: events.append((name, fields)), "m1")
    watch.check(None)  # not registered yet: nothing to say
    watch.check(session)
    assert events == [] and state.probe()[0]
    session.lost.set()
    watch.check(session)
    watch.check(session)
    assert events == [("session_lost", {"reason": "lease expired"})] and not state.probe()[0]
    session.lost.clear()
    watch.check(session)
    watch.check(session)
    assert events[1:] == [("member_joined", {"member": "m1", "rejoined": True})] and state.probe()[0]


def test_connections_beyond_the_bound_are_closed_and_slow_ones_cut_after_the_deadline(monkeypatch):
    """Security review, finding 9: slow clients cannot take a thread each without limit."""
    from elastic.agent import health as health_module

    monkeypatch.setattr(health_module._ProbeServer, "MAX_REQUESTS", 4)
    monkeypatch.setattr(health_module._ProbeServer, "deadline_s", 1.0)
    srv = HealthServer(port=0, probe=lambda: (True, "x"), host="127.0.0.1", request_timeout=30).start()
    try:
        before = threading.active_count()
        slow = []
        for _ in range(20):  # each sends a byte and then nothing: a request that never ends
            conn = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            conn.sendall(b"G")
            slow.append(conn)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and threading.active_count() - before < 4:
            time.sleep(0.02)
        time.sleep(0.3)
        assert threading.active_count() - before <= 4
        time.sleep(1.2)  # past the deadline: the next connection cuts the slow ones
        assert get(srv.port, "/healthz") == (200, "ok: x\n")
        for conn in slow:
            conn.close()
    finally:
        srv.stop()


def test_slow_clients_holding_every_slot_never_starve_the_probes():
    """Security review 2, M2: 40 slow clients racing for the 16 slots left 66 of 67 probes
    unanswered, and the kubelet killed the pod. Now a new connection takes the oldest
    request's slot, and one address holds 4 at most."""
    srv = HealthServer(port=0, probe=lambda: (True, "x"), host="127.0.0.1", request_timeout=30).start()
    stop = threading.Event()
    held: list[socket.socket] = []

    def hold(address: str) -> None:  # reconnects whenever cut, a byte every 0.2 s: never a whole request
        conns: list[socket.socket] = []
        while not stop.is_set():
            while len(conns) < 8:
                try:
                    conns.append(socket.create_connection(("127.0.0.1", srv.port), timeout=2,
                                                          source_address=(address, 0)))
                    held.append(conns[-1])
                except OSError:
                    break
            for conn in list(conns):
                try:
                    conn.sendall(b"G")
                except OSError:
                    conns.remove(conn)
            stop.wait(0.2)

    holders = [threading.Thread(target=hold, args=(f"127.0.0.{n}",), daemon=True) for n in range(2, 8)]
    try:
        for thread in holders:
            thread.start()
        time.sleep(1.0)  # every slot taken, and kept taken
        answers = [get(srv.port, "/healthz") for _ in range(20)]
        assert answers == [(200, "ok: x\n")] * 20
    finally:
        stop.set()
        for thread in holders:
            thread.join(5)
        for conn in held:
            conn.close()
        srv.stop()
