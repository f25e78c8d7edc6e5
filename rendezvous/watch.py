"""A watch that survives etcd restarts, leader changes and endpoint failover.

The `etcd3` library's watcher thread dies when etcd restarts (python3-etcd3
0.13 hits a NameError on its error path), after which its callbacks silently
see nothing. So we drive the gRPC Watch stream ourselves, in one daemon thread
per watch:

    open stream from last_revision + 1  ->  deliver events in order
         ^                                        |
         +---- backoff <---- stream broke <-------+

If etcd compacted the revisions we still need, the watch cannot resume: it
calls `on_reset()` so the owner re-reads its state, then continues from there.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2
from etcd3.utils import prefix_range_end

from .errors import RendezvousError
from .kv import KeyValue

log = logging.getLogger(__name__)

_BACKOFF_START = 0.05
_BACKOFF_CAP = 1.0
# etcd's "require leader" metadata: a member cut off from its cluster ends our
# stream (so we fail over) instead of silently delivering nothing.
_REQUIRE_LEADER = ("hasleader", "true")


@dataclass(frozen=True)
class WatchEvent:
    type: str  # "put" | "delete"
    kv: KeyValue  # for a delete: the key and its deletion revision; value == b""


def _event_from_proto(event) -> WatchEvent:
    kind = "delete" if event.type == kv_pb2.Event.DELETE else "put"
    return WatchEvent(kind, KeyValue.from_proto(event.kv))


class WatchTransport(Protocol):
    """What a watch needs of the etcd client (``etcd.Etcd`` is one): channels to the
    current endpoint, call metadata, and to be told when a stream broke."""

    def stream_channel(self) -> tuple[int, grpc.Channel]: ...

    def stream_metadata(self, channel: grpc.Channel) -> tuple: ...

    def stream_broke(self, exc: grpc.RpcError, index: int) -> None: ...

    def stream_cancelled(self, reason: str) -> None: ...

    def count_request(self) -> None: ...

    def current_revision(self) -> int: ...


class Watch:
    """Streams the events of a key (or prefix) to `on_events` until cancelled.

    on_events(list[WatchEvent]): called on the watch thread, in revision order.
    on_reset(): called when the history we needed was compacted; the owner
        re-reads its state. If it returns an int (the revision it read at),
        the watch resumes after it; otherwise after the revision current just
        before on_reset ran (some events may then be seen twice).
    """

    def __init__(
        self,
        etcd: WatchTransport,
        key: str,
        *,
        prefix: bool,
        start_revision: int,
        on_events: Callable[[list[WatchEvent]], object],
        on_reset: Callable[[], object] | None = None,
    ):
        self._etcd = etcd
        self.key = key
        self.prefix = prefix
        self._on_events = on_events
        self._on_reset = on_reset
        # start_revision <= 0 means "from now": the first created response tells us where now is.
        self._revision = max(0, start_revision - 1)
        self._from_now = start_revision <= 0
        self.ready = threading.Event()  # set once a stream is established (tests, start-up ordering)
        self.reconnects = 0  # streams re-opened after a break
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._call = None
        self._quiet = False
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch:{key}", daemon=True)
        self._thread.start()

    @property
    def revision(self) -> int:
        """The last revision whose events were delivered (or known to have none for us)."""
        return self._revision

    @property
    def active(self) -> bool:
        return self._thread.is_alive()

    def cancel(self, timeout: float = 5.0) -> None:
        """Stop the watch; waits (bounded) for its thread unless called from a callback."""
        self._stopped.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("watch on %s did not stop within %gs", self.key, timeout)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc_info) -> None:
        self.cancel()

    # -- the loop

    def _run(self) -> None:
        failures = 0
        while not self._stopped.is_set():
            try:
                delivered = self._stream_once()
            except Exception:  # a bug must not end the watch silently
                log.exception("watch on %s: unexpected error; re-watching", self.key)
                delivered = False
            if self._stopped.is_set():
                break
            failures = 0 if delivered else failures + 1
            self._quiet = failures > 1  # log the first break of a streak, not every retry
            self.reconnects += 1
            delay = min(_BACKOFF_CAP, _BACKOFF_START * 2 ** failures) * random.uniform(0.5, 1.0)
            self._stopped.wait(delay)

    def _stream_once(self) -> bool:
        """One Watch stream until it breaks. True if it got as far as being created."""
        try:
            index, channel = self._etcd.stream_channel()
            metadata = self._etcd.stream_metadata(channel)
        except grpc.RpcError as exc:
            log.log(logging.DEBUG if self._quiet else logging.INFO, "watch on %s: cannot connect (%s); retrying",
                    self.key, _reason(exc))
            self._note_failure(exc, index)
            return False
        except RendezvousError as exc:
            log.warning("watch on %s: %s; retrying", self.key, exc)
            return False

        requests: "queue.Queue[object]" = queue.Queue()
        requests.put(etcdrpc.WatchRequest(create_request=self._create_request()))
        self._etcd.count_request()
        call = etcdrpc.WatchStub(channel).Watch(_until_none(requests), metadata=(*metadata, _REQUIRE_LEADER))
        with self._lock:
            self._call = call
        if self._stopped.is_set():  # cancel() ran before _call was visible to it
            call.cancel()
        created = False
        try:
            for response in call:
                if response.created:
                    created = True
                    self.ready.set()
                    if self._from_now:
                        self._revision, self._from_now = response.header.revision, False
                if response.compact_revision:
                    return self._reset(response.compact_revision)
                if response.canceled:
                    # Counted as a failure, not a delivery: a cancellation that repeats (a
                    # stale token, a permission taken away) backs off and logs once.
                    log.log(logging.DEBUG if self._quiet else logging.WARNING,
                            "watch on %s cancelled by etcd: %s; re-watching", self.key,
                            response.cancel_reason or "no reason given")
                    self._etcd.stream_cancelled(response.cancel_reason)
                    return False
                if response.events:
                    self._deliver(response.events)
                elif not response.created and response.header.revision > self._revision:
                    # Progress notification: nothing for us up to this revision.
                    self._revision = response.header.revision
            log.info("watch on %s: stream ended; re-watching from revision %d", self.key, self._revision + 1)
        except grpc.RpcError as exc:
            if not self._stopped.is_set():
                log.log(logging.DEBUG if self._quiet else logging.INFO, "watch on %s broke (%s); re-watching from revision %d", self.key, _reason(exc),
                         self._revision + 1)
                self._note_failure(exc, index)
        finally:
            requests.put(None)  # ends the request iterator gRPC is reading from
            with self._lock:
                self._call = None
            call.cancel()
        return created

    def _create_request(self) -> etcdrpc.WatchCreateRequest:
        key = self.key.encode()
        request = etcdrpc.WatchCreateRequest(key=key, progress_notify=True)
        if self.prefix:
            request.range_end = prefix_range_end(key)
        if not self._from_now:
            request.start_revision = self._revision + 1
        return request

    def _deliver(self, raw_events) -> None:
        # After a reconnect etcd starts at last+1, so this filter only guards
        # against a duplicate if a server ever re-sends a revision.
        events = [_event_from_proto(e) for e in raw_events if e.kv.mod_revision > self._revision]
        if not events:
            return
        self._revision = max(self._revision, events[-1].kv.mod_revision)
        if self._stopped.is_set():
            return
        try:
            self._on_events(events)
        except Exception:
            log.exception("watch on %s: on_events callback failed (events dropped for this owner)", self.key)

    def _reset(self, compact_revision: int) -> bool:
        log.warning("watch on %s: revision %d was compacted (oldest kept: %d); owner re-reads state",
                    self.key, self._revision + 1, compact_revision)
        try:
            current = self._etcd.current_revision()
        except RendezvousError as exc:
            log.warning("watch on %s: cannot read the current revision (%s); retrying", self.key, exc)
            return False
        resume_after = current
        if self._on_reset is not None and not self._stopped.is_set():
            try:
                result = self._on_reset()
                if isinstance(result, int) and not isinstance(result, bool):
                    resume_after = result
            except Exception:
                log.exception("watch on %s: on_reset callback failed", self.key)
        self._revision = max(self._revision, resume_after)
        return True

    def _note_failure(self, exc: grpc.RpcError, index: int) -> None:
        self._etcd.stream_broke(exc, index)  # fail over, or log in again on the next stream


def _until_none(requests: "queue.Queue[object]") -> Iterator[object]:
    while True:
        item = requests.get()
        if item is None:
            return
        yield item


def _reason(exc: grpc.RpcError) -> str:
    code = exc.code().name if exc.code() is not None else "UNKNOWN"
    return f"{code}: {' '.join((exc.details() or '').split())}"
