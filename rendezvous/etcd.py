"""The etcd v3 client the rendezvous is built on: config, KV, txn, leases, watches.

One `Etcd` object owns one gRPC channel per endpoint (created lazily) and sends
every request through `_call`, the single place that decides what is retried:

- transient failures (gRPC UNAVAILABLE or DEADLINE_EXCEEDED, leader changes,
  an expired auth token) are retried with exponential backoff and jitter until
  `config.retry_deadline`, then raise `RendezvousConnectionError`;
- UNAVAILABLE moves us to the next endpoint first (failover);
- credentials etcd refuses raise `RendezvousAuthError` at once, never retried.

We speak to etcd through the gRPC stubs and messages of the `etcd3` library
rather than its client class: the class turns every gRPC error into an
exception without etcd's message, which is what tells a wrong password apart
from a dead server. Watches live in `watch.py` (the library's watcher thread
dies for good when etcd restarts).

Retrying a non-idempotent request after DEADLINE_EXCEEDED may repeat it: a txn
that succeeded the first time can report `succeeded=False` on the retry. Owners
of a create-if-absent txn therefore confirm a loss by reading the key back.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import grpc
import tenacity
from etcd3 import etcdrpc
from etcd3.client import MultiEndpointEtcd3Client
from etcd3.utils import prefix_range_end

from .errors import ConfigError, LeaseLostError, RendezvousAuthError, RendezvousConnectionError, RendezvousError

from .etcd_config import EtcdConfig, netloc
from .kv import KeyValue
from .tls_probe import TlsFiles, TlsVerdicts, tls_refusal
from .watch import Watch

log = logging.getLogger(__name__)

T = TypeVar("T")

# gRPC reconnects a broken channel with exponential backoff up to 120 s by default;
# after an etcd restart we want the channel back within about a second.
_CHANNEL_OPTIONS = (
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a peer that vanished without closing TCP (lost host). etcd refuses
    # pings more often than every 5 s (--grpc-keepalive-min-time).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)

_TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# etcd reports these with varying gRPC codes across versions; all mean "try again".
_TRANSIENT_MESSAGES = ("leader changed", "no leader", "request timed out", "too many requests", "not capable")
# Handshake failures surface as UNAVAILABLE, but retrying cannot fix a certificate.
_TLS_MESSAGES = ("ssl", "handshake", "certificate", "tls")


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class CreateRevisionEquals:
    """Revision 0 means the key is absent: the basis of every "create if absent"."""

    key: str
    revision: int


@dataclass(frozen=True)
class ModRevisionEquals:
    key: str
    revision: int


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int | None = None


@dataclass(frozen=True)
class Delete:
    key: str


def _compare_message(cmp) -> etcdrpc.Compare:
    msg = etcdrpc.Compare(key=cmp.key.encode(), result=etcdrpc.Compare.EQUAL)
    if isinstance(cmp, CreateRevisionEquals):
        msg.target, msg.create_revision = etcdrpc.Compare.CREATE, cmp.revision
    elif isinstance(cmp, ModRevisionEquals):
        msg.target, msg.mod_revision = etcdrpc.Compare.MOD, cmp.revision
    else:
        raise TypeError(f"not a txn comparison: {cmp!r}")
    return msg


def _op_message(op) -> etcdrpc.RequestOp:
    if isinstance(op, Put):
        return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=op.key.encode(), value=op.value, lease=op.lease or 0))
    if isinstance(op, Delete):
        return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=op.key.encode()))
    raise TypeError(f"not a txn operation: {op!r}")


# ----------------------------------------------------------------------------- errors


class _TransientError(Exception):
    """Internal: an attempt failed in a way that another attempt may fix."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _short_reason(exc: grpc.RpcError) -> str:
    """'UNAVAILABLE: Connection refused' from gRPC's long, multi-part details."""
    code = exc.code().name if exc.code() is not None else "UNKNOWN"
    details = " ".join((exc.details() or "").split())
    # "failed to connect to all addresses; last error: UNKNOWN: ipv4:...: Connection refused"
    tail = details.rsplit(": ", 1)[-1] if "last error" in details else details.removeprefix("etcdserver: ")
    return f"{code}: {tail}" if tail else code


def _tls_problem(details: str) -> str:
    """What went wrong in a TLS handshake, in words, with OpenSSL's reason."""
    reason = details.removesuffix(": OK").rsplit(":", 1)[-1].strip()
    if "ALERT_BAD_CERTIFICATE" in details or "CERTIFICATE_REQUIRED" in details:
        return f"etcd rejected our client certificate, or we sent none ({reason})"
    if "CERTIFICATE_VERIFY_FAILED" in details:
        reason = details.removesuffix(": OK").split("CERTIFICATE_VERIFY_FAILED", 1)[-1].strip(": ")
        return f"etcd's certificate does not verify against our CA ({reason or 'verify failed'})"
    return reason or "handshake failed"


class _RetryStop(tenacity.stop.stop_base):
    """Stop before the next sleep would cross the deadline.

    Counts the time spent sleeping as well as the wall time, so an injected
    no-op sleep (unit tests) still reaches the deadline.
    """

    def __init__(self, deadline: float):
        self.deadline = deadline

    def __call__(self, state: tenacity.RetryCallState) -> bool:
        spent = max(state.seconds_since_start or 0.0, state.idle_for)
        return spent + (state.upcoming_sleep or 0.0) >= self.deadline


# ----------------------------------------------------------------------------- client


class Etcd:
    """Thread-safe etcd v3 client with retries, failover, TLS and user auth."""

    def __init__(self, config: EtcdConfig, *, sleep: Callable[[float], object] | None = None):
        self.config = config
        self.requests = 0  # RPCs sent, retries included: benchmarks count etcd traffic with it
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # The default sleep wakes up when the client is closed, so close() ends retries.
        self._sleep = sleep or self._closed.wait
        self._channels: list[grpc.Channel | None] = [None] * len(config.endpoints)
        self._current = 0
        self._token: str | None = None
        self._auth_enabled = config.user is not None
        self._credentials = None
        if config.secure:
            self._credentials = MultiEndpointEtcd3Client.get_secure_creds(
                config.ca_cert, cert_key=config.cert_key, cert_cert=config.cert_cert
            )
        # Why a secure endpoint is unavailable is asked of the endpoint (tls_probe.py).
        self._tls: TlsVerdicts | None = None
        if config.secure:
            files = TlsFiles(config.ca_cert, config.cert_cert, config.cert_key)
            self._tls = TlsVerdicts(lambda host, port: tls_refusal(host, port, files, min(2.0, config.call_timeout)))
        self._watches: "weakref.WeakSet" = weakref.WeakSet()

    # -- what a watch's stream needs of the client (watch.WatchTransport)

    def stream_channel(self) -> tuple[int, grpc.Channel]:
        """(endpoint index, channel) for a new watch stream."""
        return self._channel()

    def stream_metadata(self, channel: grpc.Channel) -> tuple:
        """The call metadata of a new stream on ``channel`` (logs in first if needed)."""
        return self._metadata(channel, self.config.call_timeout)

    def count_request(self) -> None:
        self._count_request()

    def stream_broke(self, exc: grpc.RpcError, index: int) -> None:
        """A stream on endpoint ``index`` failed: fail over, or log in again next time."""
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self._failover(index)
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in (exc.details() or ""):
            self._token = None

    def stream_cancelled(self, reason: str) -> None:
        """etcd cancelled a stream for ``reason``: an etcd restarted since the login answers
        a watch with a cancellation, not an error, and a stream opened with the same token
        would be cancelled again, so the next one logs in again. etcd 3.5.1 gives that
        cancellation as "permission denied" (its watch does not tell a dead token from a
        missing permission), so that one logs in again too: a login costs one call, and
        the watch backs off if the permission really is missing."""
        lowered = reason.lower()
        if "invalid auth token" in lowered or "permission denied" in lowered:
            self._token = None

    # -- plumbing

    def _channel(self) -> tuple[int, grpc.Channel]:
        with self._lock:
            if self._closed.is_set():
                raise RendezvousError("etcd client is closed")
            index = self._current
            if self._channels[index] is None:
                target = netloc(*self.config.endpoints[index])
                if self._credentials is not None:
                    channel = grpc.secure_channel(target, self._credentials, options=_CHANNEL_OPTIONS)
                else:
                    channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
                self._channels[index] = channel
            return index, self._channels[index]

    def set_endpoints(self, endpoints: Sequence[tuple[str, int]]) -> None:
        """Talk to ``endpoints`` from now on (etcd's members changed): channels to the
        endpoints kept are kept, and so is the current one if it is among them."""
        endpoints = tuple(endpoints)
        with self._lock:
            old = self.config.endpoints
            if self._closed.is_set() or endpoints == old or not endpoints:
                return
            self.config = dataclasses.replace(self.config, endpoints=endpoints)
            kept = {old[i]: ch for i, ch in enumerate(self._channels) if ch is not None and old[i] in endpoints}
            dropped = [ch for i, ch in enumerate(self._channels) if ch is not None and old[i] not in endpoints]
            current = old[self._current]
            self._channels = [kept.get(endpoint) for endpoint in endpoints]
            self._current = endpoints.index(current) if current in endpoints else 0
        for channel in dropped:
            channel.close()
        log.info("etcd endpoints now %s", self.config.describe())

    def call(self, what: str, rpc: Callable[[grpc.Channel, float, tuple], T], *, deadline: float | None = None) -> T:
        """``rpc(channel, timeout, metadata)`` under the client's retry and failover policy
        (for the requests this class has no method for: etcd's cluster API)."""
        return self._call(what, rpc, deadline=deadline)

    def _failover(self, failed_index: int) -> None:
        with self._lock:
            # (An index from before set_endpoints may be past the end: the list moved on.)
            if self._current == failed_index < len(self._channels) and len(self._channels) > 1:
                self._current = (failed_index + 1) % len(self._channels)
                log.debug("etcd endpoint %s unavailable; trying %s", netloc(*self.config.endpoints[failed_index]),
                          netloc(*self.config.endpoints[self._current]))

    def _count_request(self) -> None:
        with self._lock:
            self.requests += 1

    def _metadata(self, channel: grpc.Channel, timeout: float) -> tuple:
        """Call metadata: the auth token, fetched on first use."""
        if not self._auth_enabled:
            return ()
        token = self._token
        if token is None:
            token = self._authenticate(channel, timeout)
        return (("token", token),) if token else ()

    def _authenticate(self, channel: grpc.Channel, timeout: float) -> str | None:
        request = etcdrpc.AuthenticateRequest(name=self.config.user, password=self.config.password)
        self._count_request()
        try:
            token = etcdrpc.AuthStub(channel).Authenticate(request, timeout=timeout).token
        except grpc.RpcError as exc:
            if "authentication is not enabled" in (exc.details() or ""):
                if self.config.require_auth:
                    raise RendezvousAuthError(
                        f"etcd at {self.config.describe()} has auth disabled although a user is configured: "
                        f"its keys are open to anyone (enable auth, or pass --allow-insecure)") from None
                log.warning("etcd at %s has auth disabled; ignoring the configured user", self.config.describe())
                self._auth_enabled = False
                return None
            raise
        self._token = token
        return token

    def _classify(self, exc: grpc.RpcError, index: int, what: str) -> Exception:
        """Turn a gRPC error into a retryable `_TransientError` or a final error."""
        code, details = exc.code(), (exc.details() or "")
        lowered = details.lower()
        where = self.config.describe()
        if self._closed.is_set():
            return RendezvousError("etcd client is closed")
        if "authentication failed" in lowered:
            return RendezvousAuthError(f"etcd at {where} rejected user {self.config.user!r}: wrong user name or password")
        if "invalid auth token" in lowered or code == grpc.StatusCode.UNAUTHENTICATED:
            if self._auth_enabled:
                self._token = None  # tokens die with an etcd restart: log in again
                return _TransientError("auth token expired")
            return RendezvousAuthError(f"etcd at {where} refused the request: {_short_reason(exc)}")
        if "user name is empty" in lowered:
            return RendezvousAuthError(f"etcd at {where} requires authentication: configure a user and password")
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return RendezvousAuthError(f"etcd at {where} denied {what} to user {self.config.user!r}: permission denied")
        if code == grpc.StatusCode.UNAVAILABLE and self._tls is not None and index < len(self.config.endpoints):
            # gRPC's words for a refused certificate vary with the server and the timing
            # of its alert; the server's own answer to a handshake does not.
            refusal = self._tls.refusal(*self.config.endpoints[index])
            # "Shutting down endpoint", "Endpoint closing": a handshake cut short (our own
            # deadline on a loaded host, a server restarting), not refused: retried below.
            cut_short = any(m in lowered for m in ("shutting down", "endpoint closing"))
            if refusal is None and any(m in lowered for m in _TLS_MESSAGES) and not cut_short:
                refusal = _tls_problem(details)
            if refusal is not None:
                return RendezvousAuthError(f"TLS handshake with etcd at {where} failed: {refusal}")
        if code in _TRANSIENT_CODES or any(m in lowered for m in _TRANSIENT_MESSAGES):
            if code in _TRANSIENT_CODES:  # a host cut off answers nothing: deadline, not refusal
                self._failover(index)
            return _TransientError(_short_reason(exc))
        return RendezvousError(f"etcd {what} failed: {_short_reason(exc)}")

    def _call(self, what: str, rpc: Callable[[grpc.Channel, float, tuple], T], *, deadline: float | None = None) -> T:
        """Run `rpc(channel, timeout, metadata)` with the retry policy."""
        deadline = self.config.retry_deadline if deadline is None else deadline
        started = time.monotonic()

        def attempt() -> T:
            index, channel = self._channel()
            # Never let one attempt overrun the overall deadline by a whole call_timeout.
            timeout = max(0.05, min(self.config.call_timeout, deadline - (time.monotonic() - started)))
            try:
                metadata = self._metadata(channel, timeout)
                self._count_request()
                return rpc(channel, timeout, metadata)
            except grpc.RpcError as exc:
                raise self._classify(exc, index, what) from exc

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_TransientError),
            wait=tenacity.wait_exponential_jitter(multiplier=0.05, max=1.0, jitter=0.05),
            stop=_RetryStop(deadline),
            sleep=self._sleep,
            before_sleep=lambda state: log.debug("etcd %s failed (%s); retrying", what, state.outcome.exception()),
            reraise=True,
        )
        try:
            return retrying(attempt)
        except _TransientError as exc:
            if self._closed.is_set():
                raise RendezvousError("etcd client is closed") from exc.__cause__
            raise RendezvousConnectionError(
                f"cannot reach etcd at {self.config.describe()} within {deadline:.3g}s: {exc.reason}"
            ) from exc.__cause__

    # -- public API

    def check(self, timeout: float = 3.0) -> None:
        """Raise RendezvousConnectionError (or RendezvousAuthError) unless etcd answers within ~timeout.

        With a user configured, logging in proves the password. Without one, a
        tiny read finds out whether etcd wants credentials we do not have.
        """

        def rpc(ch, t, md):
            etcdrpc.MaintenanceStub(ch).Status(etcdrpc.StatusRequest(), timeout=t, metadata=md)
            if not self._auth_enabled:
                etcdrpc.KVStub(ch).Range(etcdrpc.RangeRequest(key=b"\0", count_only=True), timeout=t, metadata=md)

        self._call("check", rpc, deadline=timeout)

    def get(self, key: str, *, retry_deadline: float | None = None) -> KeyValue | None:
        request = etcdrpc.RangeRequest(key=key.encode())
        response = self._call(f"get {key}", lambda ch, t, md: etcdrpc.KVStub(ch).Range(request, timeout=t, metadata=md),
                              deadline=retry_deadline)
        return KeyValue.from_proto(response.kvs[0]) if response.kvs else None

    def get_prefix(self, prefix: str, *, retry_deadline: float | None = None) -> tuple[list[KeyValue], int]:
        """All keys under `prefix`, sorted by key, and the revision they were read at."""
        request = etcdrpc.RangeRequest(
            key=prefix.encode(),
            range_end=prefix_range_end(prefix.encode()),
            sort_order=etcdrpc.RangeRequest.ASCEND,
            sort_target=etcdrpc.RangeRequest.KEY,
        )
        response = self._call(f"get prefix {prefix}",
                              lambda ch, t, md: etcdrpc.KVStub(ch).Range(request, timeout=t, metadata=md),
                              deadline=retry_deadline)
        return [KeyValue.from_proto(kv) for kv in response.kvs], response.header.revision

    def current_revision(self) -> int:
        """The store's current revision (Status needs no read permission on any key)."""
        response = self._call("read revision", lambda ch, t, md: etcdrpc.MaintenanceStub(ch).Status(
            etcdrpc.StatusRequest(), timeout=t, metadata=md))
        return response.header.revision

    def put(self, key: str, value: bytes, lease: int | None = None, *, retry_deadline: float | None = None) -> int:
        request = etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease or 0)
        response = self._call(f"put {key}", lambda ch, t, md: etcdrpc.KVStub(ch).Put(request, timeout=t, metadata=md),
                              deadline=retry_deadline)
        return response.header.revision

    def delete(self, key: str) -> bool:
        request = etcdrpc.DeleteRangeRequest(key=key.encode())
        response = self._call(f"delete {key}",
                              lambda ch, t, md: etcdrpc.KVStub(ch).DeleteRange(request, timeout=t, metadata=md))
        return response.deleted > 0

    def txn(self, compare: Sequence, success: Sequence, failure: Sequence = (), *,
            retry_deadline: float | None = None) -> tuple[bool, int]:
        """Apply `success` if every comparison holds, else `failure`: (succeeded, revision)."""
        request = etcdrpc.TxnRequest(
            compare=[_compare_message(c) for c in compare],
            success=[_op_message(op) for op in success],
            failure=[_op_message(op) for op in failure],
        )
        response = self._call("txn", lambda ch, t, md: etcdrpc.KVStub(ch).Txn(request, timeout=t, metadata=md),
                              deadline=retry_deadline)
        return response.succeeded, response.header.revision

    def grant_lease(self, ttl: float, *, retry_deadline: float | None = None) -> int:
        """A new lease of `ttl` seconds (rounded up to whole seconds, at least 1)."""
        if not ttl > 0:
            raise ConfigError(f"invalid lease ttl {ttl!r}: must be positive")
        request = etcdrpc.LeaseGrantRequest(TTL=max(1, math.ceil(ttl)))
        response = self._call("lease grant", lambda ch, t, md: etcdrpc.LeaseStub(ch).LeaseGrant(
            request, timeout=t, metadata=md), deadline=retry_deadline)
        if response.error:
            raise RendezvousError(f"etcd refused a lease of {ttl:g}s: {response.error}")
        return response.ID

    def refresh_lease(self, lease_id: int, *, retry_deadline: float | None = None) -> float:
        """Keep the lease alive once; returns its remaining TTL. LeaseLostError if it is gone."""
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)

        def rpc(ch, t, md):
            # LeaseKeepAlive is a stream; one request, one response is a refresh.
            responses = etcdrpc.LeaseStub(ch).LeaseKeepAlive(iter([request]), timeout=t, metadata=md)
            try:
                return next(responses)
            except StopIteration:
                raise _TransientError("lease keep-alive stream ended without an answer") from None
            finally:
                responses.cancel()

        response = self._call(f"lease refresh {lease_id:x}", rpc, deadline=retry_deadline)
        if response.TTL <= 0:
            raise LeaseLostError(f"etcd lease {lease_id:x} expired or was revoked")
        return float(response.TTL)

    def lease_time_to_live(self, lease_id: int) -> float:
        """Remaining TTL of a lease without refreshing it; -1 if it is gone."""
        request = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id)
        response = self._call(f"lease ttl {lease_id:x}", lambda ch, t, md: etcdrpc.LeaseStub(ch).LeaseTimeToLive(
            request, timeout=t, metadata=md))
        return float(response.TTL)

    def revoke_lease(self, lease_id: int, *, retry_deadline: float | None = None) -> None:
        """Revoke now: every key on the lease vanishes. A lease already gone is fine."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)

        def rpc(ch, t, md):
            try:
                etcdrpc.LeaseStub(ch).LeaseRevoke(request, timeout=t, metadata=md)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise

        self._call(f"lease revoke {lease_id:x}", rpc, deadline=retry_deadline)

    def watch(self, key: str, *, prefix: bool, start_revision: int, on_events, on_reset=None) -> Watch:
        """Start a resilient watch (see watch.Watch); cancel it or close the client to stop it."""
        watch = Watch(self, key, prefix=prefix, start_revision=start_revision, on_events=on_events, on_reset=on_reset)
        self._watches.add(watch)
        return watch

    def close(self) -> None:
        """Cancel the watches, end pending retries and close the channels."""
        if self._closed.is_set():
            return
        for watch in list(self._watches):
            watch.cancel()
        with self._lock:
            self._closed.set()
            channels, self._channels = self._channels, [None] * len(self._channels)
        for channel in channels:
            if channel is not None:
                channel.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Etcd({self.config.describe()})"

