"""The agent's HTTP health endpoint, for Kubernetes readiness and liveness probes.

Two small pieces, kept apart so each can be tested alone:

- `HealthState` is what the agent drives: it is told when the agent has registered
  in the rendezvous and when its etcd session (the lease behind its member key) is
  lost or healthy again, and turns that into a `(healthy, detail)` verdict.
- `SessionMonitor` checks from a daemon thread that the agent's lease is still
  alive in etcd and tells the `HealthState`; the probe fails once no check has
  succeeded for longer than the TTL, even while a check is still blocked retrying
  (the session itself only gives up after max(ttl, retry deadline)).
- `HealthServer` serves any such verdict over HTTP from a daemon thread:
  GET /healthz and /readyz -> 200 "ok: <detail>" or 503 "<detail>";
  and, when given an exposition function, GET /metrics -> Prometheus' text format
  (the metrics themselves are metrics.py's).

A session lost for less than the TTL is still healthy on purpose: etcd being briefly
unavailable (a restart, a leader change) must not get a training pod killed. Past the
TTL the lease has expired, the other members have dropped this host, and a restart
of the pod is the way back in.
"""

from __future__ import annotations

import http.server
import logging
import socket
import threading
import time
from typing import Callable

from elastic.rendezvous import ConfigError

logger = logging.getLogger(__name__)

Probe = Callable[[], "tuple[bool, str]"]
Exposition = Callable[[], bytes]
METRICS_PATH = "/metrics"
# Prometheus' text format, version 0.0.4 (what prometheus_client's generate_latest writes).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Both paths answer the same verdict: the agent has no state in which it should take
# no traffic yet must not be restarted (no Service sends traffic to workers; readiness
# only gates rollouts and shows in `kubectl get pods`).
PROBE_PATHS = frozenset({"/healthz", "/readyz"})


class HealthState:
    """Registration and etcd-session status of one agent, as a probe verdict.

    Thread-safe: the agent writes from its own threads while the HTTP server reads.
    `clock` must be the clock the `since` values passed to `mark_session_lost` come
    from (default `time.monotonic`).
    """

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl > 0:
            raise ValueError(f"HealthState ttl must be > 0 seconds, got {ttl!r}")
        self.ttl = float(ttl)
        self._clock = clock
        self._lock = threading.Lock()
        self._registered = False
        self._lost_since: float | None = None
        self._checked = False  # a SessionMonitor reports: stale checks count as an outage
        self._last_ok: float | None = None  # clock() of the last successful check
        self._dead: str | None = None  # the session gave up for good: why

    def mark_registered(self) -> None:
        """The agent holds a member key in the rendezvous: healthy from now on."""
        with self._lock:
            self._registered = True
            self._lost_since = None
            self._last_ok = self._clock()  # registering took a working session

    def mark_revived(self) -> None:
        """A session that was given up came back on a new lease (a partition healed)."""
        with self._lock:
            self._dead = None
            self._lost_since = None
            self._last_ok = self._clock()

    def mark_session_ok(self) -> None:
        """A keep-alive (or a new session) succeeded: the outage, if any, is over."""
        with self._lock:
            self._lost_since = None
            self._last_ok = self._clock()

    def expect_checks(self) -> None:
        """From now on, no successful check for longer than the TTL is an outage."""
        with self._lock:
            self._checked = True
            if self._last_ok is None:
                self._last_ok = self._clock()

    def mark_session_dead(self, reason: str) -> None:
        """The session gave up (its lease is gone for good): unhealthy from now on."""
        with self._lock:
            self._dead = reason

    def mark_session_lost(self, since: float) -> None:
        """The etcd session has been failing since `since` (a `clock` reading).

        Repeated reports during one outage keep the earliest start, so a retry loop
        can report every failure without resetting the outage's age.
        """
        with self._lock:
            if self._lost_since is None or since < self._lost_since:
                self._lost_since = since

    def probe(self) -> tuple[bool, str]:
        """(healthy, detail) for the health endpoint."""
        with self._lock:
            registered, lost_since = self._registered, self._lost_since
            checked, last_ok, dead = self._checked, self._last_ok, self._dead
        if not registered:
            return False, "not registered yet"
        if dead is not None:
            return False, f"etcd session lost: {dead}"
        if checked and last_ok is not None and self._clock() - last_ok > self.ttl:
            # No check has worked for a TTL: the outage began right after the last one that did.
            lost_since = last_ok if lost_since is None else min(lost_since, last_ok)
        if lost_since is None:
            return True, "registered, etcd session ok"
        lost_for = max(0.0, self._clock() - lost_since)
        if lost_for > self.ttl:
            return False, f"etcd session lost for {lost_for:.1f}s (ttl {self.ttl:g}s)"
        return True, f"etcd session lost for {lost_for:.1f}s, within ttl {self.ttl:g}s"


class SessionMonitor:
    """Run `check()` (True: our lease is alive in etcd) every `interval` seconds.

    A check may block for a long time while the etcd client retries; the verdict
    does not wait for it, because `HealthState` ages the last successful check.
    """

    def __init__(self, state: HealthState, check: Callable[[], bool], interval: float) -> None:
        if not interval > 0:
            raise ValueError(f"SessionMonitor interval must be > 0 seconds, got {interval!r}")
        self._state = state
        self._check = check
        self._interval = float(interval)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-session-monitor", daemon=True)

    def start(self) -> "SessionMonitor":
        self._state.expect_checks()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop checking; a check blocked in etcd ends on its own (daemon thread)."""
        self._stop.set()
        self._thread.join(timeout=0.5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                ok = bool(self._check())
            except Exception as exc:  # etcd unreachable: the verdict ages on its own
                logger.debug("session check failed: %s: %s", type(exc).__name__, exc)
                ok = False
            if ok and not self._stop.is_set():
                self._state.mark_session_ok()


class SessionWatch:
    """The agent's etcd session as health marks and events: lost (a partition outlasted
    the lease), and back (the session registered us again on a new lease, so our
    workers join the job at its next commit as new members). Called each agent turn."""

    def __init__(self, health: HealthState, emit: Callable[..., None], member_id: str) -> None:
        self._health, self._emit, self._member_id = health, emit, member_id
        self._lost = False

    def check(self, session) -> None:
        if session is None:
            return
        if session.lost.is_set() and not self._lost:
            self._lost = True
            self._health.mark_session_dead(session.lost_reason or "lease lost")
            self._emit("session_lost", reason=session.lost_reason or "lease lost")
        elif not session.lost.is_set() and self._lost:
            self._lost = False
            self._health.mark_revived()
            self._emit("member_joined", member=self._member_id, rejoined=True)


class _ProbeHandler(http.server.BaseHTTPRequestHandler):
    # Set per server class in HealthServer.start (one handler class per server).
    probe: Probe
    metrics: "Exposition | None" = None

    def do_GET(self) -> None:  # noqa: N802 - name fixed by http.server
        path = self.path.split("?", 1)[0]
        if path == METRICS_PATH and type(self).metrics is not None:
            self._metrics()
            return
        if path not in PROBE_PATHS:
            self._answer(404, f"not found: {path} (try /healthz or /readyz)")
            return
        try:
            healthy, detail = type(self).probe()
        except Exception as exc:  # a broken probe is an unhealthy agent, not a dead server
            logger.warning("health probe raised %s: %s", type(exc).__name__, exc)
            self._answer(503, f"probe failed: {type(exc).__name__}: {exc}")
            return
        if healthy:
            self._answer(200, f"ok: {detail}")
        else:
            self._answer(503, detail)

    def _metrics(self) -> None:
        try:
            body = type(self).metrics()
        except Exception as exc:  # a broken collector must not take the probes down
            logger.warning("metrics exposition raised %s: %s", type(exc).__name__, exc)
            self._answer(500, f"metrics failed: {type(exc).__name__}: {exc}")
            return
        self._answer(200, body, METRICS_CONTENT_TYPE)

    def _answer(self, status: int, text: "str | bytes", content_type: str = "text/plain; charset=utf-8") -> None:
        body = text if isinstance(text, bytes) else (text + "\n").encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib name
        # Probes arrive every few seconds: keep them out of the agent's log.
        logger.debug("health %s - %s", self.address_string(), format % args)


class _ProbeServer(http.server.ThreadingHTTPServer):
    """One thread per request, as daemons (a stuck prober must never keep the agent from
    exiting), but remembered: ``stop()`` waits for them, bounded by the handler's socket
    timeout, so nothing of the server runs once it has stopped. (With plain daemon
    threads a request thread could still be closing its connection after ``stop()``.)

    Bounded (security review, finding 9): at most ``MAX_REQUESTS`` at once; and a
    request that has not ended ``deadline_s`` after it arrived (a client that sends a
    byte every few seconds: the handler's timeout is per read) has its connection shut
    down when the next one arrives. A new connection is never turned away for want of a
    slot: the oldest request gives its slot up, since every honest one (a probe, a
    scrape) ends in milliseconds, and one address holds ``MAX_PER_ADDRESS`` at most.
    Slow clients holding every slot once left 66 of 67 probes unanswered and the kubelet
    killed the pod (security review 2, M2)."""

    daemon_threads = True
    MAX_REQUESTS = 16
    MAX_PER_ADDRESS = 4
    deadline_s = 10.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._requests: list[tuple[threading.Thread, socket.socket, float, str]] = []
        self._requests_lock = threading.Lock()

    def process_request(self, request, client_address) -> None:
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name="health-request", daemon=True)
        now = time.monotonic()
        with self._requests_lock:
            current = []
            for entry in self._requests:
                if not entry[0].is_alive():
                    continue
                if now - entry[2] > self.deadline_s:
                    _shut(entry[1])  # its thread ends at its next read
                else:
                    current.append(entry)
            address = str(client_address[0]) if isinstance(client_address, tuple) else str(client_address)
            if sum(1 for entry in current if entry[3] == address) >= self.MAX_PER_ADDRESS:
                self._requests = current
                self.shutdown_request(request)
                return
            if len(current) >= self.MAX_REQUESTS:
                _shut(current.pop(0)[1])  # the oldest: its thread ends at its next read
            self._requests = current + [(thread, request, now, address)]
        thread.start()

    def join_requests(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._requests_lock:
            requests = [entry[0] for entry in self._requests]
        for thread in requests:
            thread.join(max(0.0, deadline - time.monotonic()))


def _shut(connection: socket.socket) -> None:
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its handler


class HealthServer:
    """Tiny HTTP server (stdlib http.server in a daemon thread) for pod probes."""

    def __init__(self, port: int, probe: Probe, host: str = "127.0.0.1", metrics: "Exposition | None" = None,
                 request_timeout: float = 5.0) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"health port must be in 0..65535, got {port!r}")
        self._request_timeout = request_timeout  # a prober that stops talking is cut off after this
        self._requested_port = port
        self._probe = probe
        self._metrics = metrics
        self._host = host
        self._server: _ProbeServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port once started (the kernel's choice when 0 was given)."""
        if self._server is not None:
            return self._server.server_address[1]
        return self._requested_port

    def start(self) -> "HealthServer":
        if self._server is not None:
            raise RuntimeError("HealthServer already started")
        handler = type("HealthProbeHandler", (_ProbeHandler,), {
            "probe": staticmethod(self._probe),
            "metrics": staticmethod(self._metrics) if self._metrics is not None else None,
            "timeout": self._request_timeout,  # the request socket's timeout (StreamRequestHandler)
        })
        try:
            server = _ProbeServer((self._host, self._requested_port), handler)
        except OSError as exc:  # in use, or an address not of this host: the user's to fix (exit 2)
            raise ConfigError(f"--health-port {self._requested_port}: cannot listen on {self._host}:"
                              f"{self._requested_port}: {exc.strerror or exc}") from None
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2},
            name=f"health-server-{self.port}", daemon=True,
        )
        self._thread.start()
        paths = "/healthz, /readyz" + (", /metrics" if self._metrics is not None else "")
        logger.info("health endpoint listening on %s:%d (%s)", self._host, self.port, paths)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket; safe to call twice."""
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)
        server.join_requests(self._request_timeout + 1.0)
        self._server = self._thread = None

    def __enter__(self) -> "HealthServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
