"""The store an agent serves, in Python: torch's TCPStore clients talk to it unchanged.

An agent serves two kinds of store (the round store its member record advertises, and a
fresh store per round for torchrun-style scripts: plain_store.py). Its workers reach
them with torch's own C++ client (``dist.TCPStore(is_master=False)``, gloo's and NCCL's
rendezvous, ``env://``). The server was torch's too, and it was the only reason the
launcher imported torch: 1.4 s of every ``elastic-run`` start on an idle 2-core host,
3.5 s of CPU per agent (issue 30). This one speaks the same protocol (store_wire.py)
over the same state (store_table.py) in one thread: a ``selectors`` loop over
non-blocking sockets that serves from the moment the port is bound, so a client never
waits for it. Each request is short work under the GIL and the loop sleeps in
``select``, so the agent's other threads keep their turn.

The socket is bound to the job's address (``--host-addr``), not to every interface:
the store has no authentication while its keys decide switches and stops (security
review, finding 2), so only the job's network should reach it. Where this host does not
hold that address (NAT, where peers reach us through a translated one) it falls back
to every interface, and says so once. A peer that sends what torch's client never
sends (garbage, a key over 8 KiB, a value over 8 MiB) loses its connection, and only
it; a peer that stops reading its answers is not read from until it does.

Every peer is bounded (security review 2, H3 and M5), since on Slurm and bare metal every
user of the cluster reaches the job's address: connections (in all and per address, well
below the descriptors the process may open, whose soft limit is raised to the hard one);
time (a connection that does not validate within ``VALIDATE_S``, or leaves its answers
unread for ``STALLED_S``, is closed); memory (a request is refused once it announces more
than ``MAX_REQUEST_LEN``; parsing a connection's requests stops as soon as the answers it
has not taken pass ``_OUT_HIGH``, inside one read too; the bytes buffered for all
connections together are capped; the table's own caps are store_table.py's). A failure
while serving one connection (``MemoryError`` too) drops that connection only; one of the
loop itself restarts the loop, and past ``_RESTARTS`` a minute the store says so loudly,
closes, and tells its owner (``on_failure``), whose ``started()`` then returns None.
Dropped connections are logged once a minute per peer address, with a count.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Callable, Optional

from .store_table import StoreTable
from .store_wire import Need, RequestParser, WireError

try:
    import resource
except ImportError:  # not POSIX
    resource = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_BACKLOG = 512  # every worker of a large job may connect at once
_RECV = 64 * 1024  # read at most this much of one connection per turn: the others get theirs
_OUT_HIGH = 4 * 1024 * 1024  # answers not yet taken by the peer: stop reading its requests above this
_ACCEPT_PAUSE_S = 0.5  # out of descriptors: try accepting again after this
_CLOSE_WAIT_S = 5.0
VALIDATE_S = 5.0  # torch's client validates as it connects
STALLED_S = 30.0  # answers left unread this long: the peer is not a client that waits for them
MAX_PER_ADDRESS = 256  # connections from one address (a host's workers, their process groups' clients)
MAX_BUFFERED = 512 * 1024 * 1024  # requests and answers buffered for all connections together
_DESCRIPTOR_RESERVE = 256  # descriptors left to the agent (logs, pipes, etcd) when connections are capped
_SWEEP_S = 1.0
_RESTARTS = 3  # failures of the loop itself within a minute before the store gives up
_LOG_EVERY_S = 60.0


def _listening_socket(addr: str) -> socket.socket:
    """A listening, non-blocking socket on ``addr`` (or every interface)."""
    try:  # an address or a name (--host-addr may be either)
        family, _, _, _, address = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    except OSError:
        family, address = (socket.AF_INET6 if ":" in addr else socket.AF_INET), None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            if address is None:
                raise OSError(f"cannot resolve {addr}")
            sock.bind(address)
        except OSError as exc:
            log.warning("the store cannot bind %s (%s): it listens on every interface", addr, exc)
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        sock.listen(_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Conn:
    """One client's connection: what it sent that is not parsed yet, what we owe it."""

    __slots__ = ("sock", "peer", "address", "inbuf", "need", "out", "parser", "mask", "closed", "opened",
                 "unread_since")

    def __init__(self, sock: socket.socket, peer: str, address: str):
        self.sock, self.peer, self.address = sock, peer, address
        self.inbuf = bytearray()
        self.need = 0  # bytes the next request needs before parsing it again is worth it
        self.out = bytearray()
        self.parser = RequestParser(validated=False)
        self.mask = selectors.EVENT_READ
        self.closed = False
        self.opened = time.monotonic()
        self.unread_since: Optional[float] = None  # answers waiting for the peer since

    @property
    def buffered(self) -> int:
        return len(self.inbuf) + len(self.out)


def connection_limit() -> int:
    """How many connections a store accepts: the soft descriptor limit (raised to the
    hard one first) less a reserve for the agent's own files."""
    soft = 1024
    if resource is not None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
        if soft == resource.RLIM_INFINITY:
            soft = 65536
    return max(16, min(8192, (soft - _DESCRIPTOR_RESERVE) // 2))  # two stores per agent


class StoreServer:
    """One store: ``port`` and served at once; ``list_keys``/``delete_key`` in process."""

    def __init__(self, addr: str, name: str = "store", on_failure: Optional[Callable[[str], None]] = None,
                 max_connections: Optional[int] = None):
        self._sock = _listening_socket(addr)
        self.addr = addr
        self.port: int = self._sock.getsockname()[1]
        self._name = name
        self._table = StoreTable()
        self._lock = threading.Lock()  # the table: the server's thread, and the agent's pruning
        self._closed = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._sock, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._accept_again: Optional[float] = None
        self._conns: dict[int, _Conn] = {}  # by id()
        self._per_address: dict[str, int] = {}
        self._buffered = 0  # bytes in every connection's inbuf and out (approximately: after each turn)
        self._max_connections = max_connections if max_connections is not None else connection_limit()
        self._on_failure = on_failure
        self.failure: Optional[str] = None  # why the store stopped by itself
        self._dropped: dict[str, tuple[float, int]] = {}  # address -> (last logged, drops since)
        self._thread = threading.Thread(target=self._serve, name=f"{name}-server", daemon=True)
        self._thread.start()

    # -- the agent's side ------------------------------------------------------------
    def started(self) -> Optional["StoreServer"]:
        """This store, or None once closed or stopped by a failure (never waits)."""
        return None if self._closed or not self._thread.is_alive() else self

    @property
    def connections(self) -> int:
        return len(self._conns)

    def list_keys(self) -> list[str]:
        """The keys as torch's client lists them (without its "/" prefix)."""
        with self._lock:
            return self._table.list_keys()

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._table.delete_key(key)

    def close(self) -> None:
        """Stop serving: every connection closes, the port is released."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(_CLOSE_WAIT_S)

    # -- the server's thread -----------------------------------------------------------
    def _serve(self) -> None:
        failures: list[float] = []
        try:
            while not self._closed:
                try:
                    self._loop()
                except Exception as exc:  # noqa: BLE001 - a bug of ours, or memory: never silent
                    now = time.monotonic()
                    failures = [t for t in failures if now - t < 60.0] + [now]
                    if len(failures) > _RESTARTS:
                        self.failure = f"{type(exc).__name__}: {exc}"
                        log.error("the store at port %d stopped: %s (%d failures within a minute)",
                                  self.port, self.failure, len(failures))
                        return
                    log.error("the store at port %d failed (%s: %s); serving again", self.port,
                              type(exc).__name__, exc)
        finally:
            self._closed = True
            for conn in list(self._conns.values()):
                conn.sock.close()
            self._conns.clear()
            self._selector.close()
            self._sock.close()
            self._wake_r.close()
            self._wake_w.close()
            if self.failure is not None and self._on_failure is not None:
                self._on_failure(self.failure)

    def _loop(self) -> None:
        next_sweep = time.monotonic() + _SWEEP_S
        while not self._closed:
            now = time.monotonic()
            timeout = max(0.0, next_sweep - now)
            if self._accept_again is not None:
                if self._accept_again <= now:
                    self._accept_again = None
                    self._selector.register(self._sock, selectors.EVENT_READ, "accept")
                else:
                    timeout = min(timeout, self._accept_again - now)
            for key, events in self._selector.select(timeout):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    self._wake_r.recv(64)
                else:
                    conn = key.data
                    try:
                        self._on_ready(conn, events)
                    except Exception as exc:  # noqa: BLE001 - MemoryError included: this peer pays
                        self._refuse(conn, f"{type(exc).__name__}: {exc}")
            if time.monotonic() >= next_sweep:
                self._sweep()
                next_sweep = time.monotonic() + _SWEEP_S

    def _sweep(self) -> None:
        """Close connections that never validated, or left their answers unread too long."""
        now = time.monotonic()
        self._buffered = sum(conn.buffered for conn in self._conns.values())
        for conn in list(self._conns.values()):
            if not conn.parser.validated and now - conn.opened > VALIDATE_S:
                self._refuse(conn, f"no validation within {VALIDATE_S:g}s")
            elif conn.unread_since is not None and now - conn.unread_since > STALLED_S:
                self._refuse(conn, f"answers left unread for {STALLED_S:g}s")

    def _accept(self) -> None:
        for _ in range(64):  # a burst of connections, then the connected clients get a turn
            try:
                sock, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors (EMFILE): the backlog keeps them meanwhile
                log.warning("the store at port %d cannot accept a connection now (%s); retrying in %gs",
                            self.port, exc, _ACCEPT_PAUSE_S)
                self._selector.unregister(self._sock)
                self._accept_again = time.monotonic() + _ACCEPT_PAUSE_S
                return
            address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            if len(self._conns) >= self._max_connections or \
                    self._per_address.get(address, 0) >= min(MAX_PER_ADDRESS, self._max_connections):
                sock.close()
                self._note_drop(address, f"over {self._max_connections} connections in all or "
                                         f"{MAX_PER_ADDRESS} from one address")
                continue
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # answers are tiny: send each now
            except OSError:
                pass
            conn = _Conn(sock, f"{address}:{peer[1]}" if isinstance(peer, tuple) else address, address)
            self._conns[id(conn)] = conn
            self._per_address[address] = self._per_address.get(address, 0) + 1
            self._selector.register(sock, conn.mask, conn)

    def _on_ready(self, conn: _Conn, events: int) -> None:
        if conn.closed:
            return
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
            if not conn.closed and conn.inbuf and len(conn.out) < _OUT_HIGH and len(conn.inbuf) >= conn.need:
                self._parse(conn)  # requests read before it stopped taking its answers
        if events & selectors.EVENT_READ and not conn.closed:
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client is gone (a worker exited, a wait's timeout, a kill)
            self._drop(conn)
            return
        if self._buffered + len(data) > MAX_BUFFERED and conn.buffered > _RECV:
            self._refuse(conn, f"the store buffers {MAX_BUFFERED} bytes for all connections at most")
            return
        conn.inbuf += data
        self._buffered += len(data)
        if len(conn.inbuf) >= conn.need:
            self._parse(conn)

    def _parse(self, conn: _Conn) -> None:
        """Answer the whole requests in ``conn.inbuf``; stop while the answers the peer has
        not taken are past ``_OUT_HIGH`` (the rest waits in inbuf until it takes them)."""
        while not conn.closed:
            replies, pos, error, parsed = [], 0, None, None
            owed = len(conn.out)
            with self._lock:
                try:
                    while pos < len(conn.inbuf) and owed < _OUT_HIGH:
                        parsed = conn.parser.feed(conn.inbuf, pos)
                        if isinstance(parsed, Need):
                            break
                        request, pos = parsed
                        answers = self._table.handle(conn, request)
                        owed += sum(len(data) for to, data in answers if to is conn)
                        replies += answers
                except WireError as exc:
                    error = str(exc)
                except Exception as exc:  # noqa: BLE001 - a bug of ours, or memory: this client only pays
                    error = f"{type(exc).__name__}: {exc}"
            conn.need = parsed.size if isinstance(parsed, Need) and error is None else 0
            del conn.inbuf[:pos]
            self._buffered -= pos
            self._send(replies)
            if error is not None:
                self._refuse(conn, error)
                return
            if not conn.inbuf or isinstance(parsed, Need) or len(conn.out) >= _OUT_HIGH:
                return
            # It stopped at _OUT_HIGH and the peer has taken its answers since: go on.

    def _send(self, replies) -> None:
        touched: dict[int, _Conn] = {}
        for conn, data in replies:
            if not conn.closed:
                conn.out += data
                self._buffered += len(data)
                touched[id(conn)] = conn
        for conn in touched.values():
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(conn)
                return
            del conn.out[:sent]
            self._buffered -= sent
            if conn.out and (sent or conn.unread_since is None):
                conn.unread_since = time.monotonic()
        if not conn.out:
            conn.unread_since = None
        below = len(conn.out) < _OUT_HIGH
        mask = (selectors.EVENT_WRITE if conn.out else 0) | (selectors.EVENT_READ if below else 0)
        if mask != conn.mask:
            conn.mask = mask
            self._selector.modify(conn.sock, mask, conn)

    def _refuse(self, conn: _Conn, why: str) -> None:
        self._note_drop(conn.address, why, conn.peer)
        self._drop(conn)

    def _note_drop(self, address: str, why: str, peer: Optional[str] = None) -> None:
        """One warning per peer address a minute, with how many were dropped meanwhile
        (a stranger's junk must not flood the agent's log: review 2, L6)."""
        now = time.monotonic()
        last, count = self._dropped.get(address, (-_LOG_EVERY_S, 0))
        if now - last < _LOG_EVERY_S:
            self._dropped[address] = (last, count + 1)
            return
        more = f" ({count} more from {address} within the last minute)" if count else ""
        log.warning("the store at port %d dropped the connection of %s: %s%s", self.port, peer or address, why, more)
        self._dropped[address] = (now, 0)
        if len(self._dropped) > 4096:  # addresses seen once long ago
            self._dropped = {a: v for a, v in self._dropped.items() if now - v[0] < _LOG_EVERY_S}

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        with self._lock:
            self._table.forget(conn)
        self._buffered -= conn.buffered
        conn.inbuf, conn.out = bytearray(), bytearray()
        self._conns.pop(id(conn), None)
        left = self._per_address.get(conn.address, 1) - 1
        if left > 0:
            self._per_address[conn.address] = left
        else:
            self._per_address.pop(conn.address, None)
        self._selector.unregister(conn.sock)
        conn.sock.close()
