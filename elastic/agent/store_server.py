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
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Optional

from .store_table import StoreTable
from .store_wire import Need, WireError, parse_request

log = logging.getLogger(__name__)

_BACKLOG = 512  # every worker of a large job may connect at once
_RECV = 64 * 1024  # read at most this much of one connection per turn: the others get theirs
_OUT_HIGH = 4 * 1024 * 1024  # answers not yet taken by the peer: stop reading its requests above this
_ACCEPT_PAUSE_S = 0.5  # out of descriptors: try accepting again after this
_CLOSE_WAIT_S = 5.0


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

    __slots__ = ("sock", "peer", "inbuf", "need", "out", "validated", "mask", "closed")

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self.inbuf = bytearray()
        self.need = 0  # bytes the next request needs before parsing it again is worth it
        self.out = bytearray()
        self.validated = False
        self.mask = selectors.EVENT_READ
        self.closed = False


class StoreServer:
    """One store: ``port`` and served at once; ``list_keys``/``delete_key`` in process."""

    def __init__(self, addr: str, name: str = "store"):
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
        self._thread = threading.Thread(target=self._serve, name=f"{name}-server", daemon=True)
        self._thread.start()

    # -- the agent's side ------------------------------------------------------------
    def started(self) -> Optional["StoreServer"]:
        """This store, or None once closed (never waits)."""
        return None if self._closed else self

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
        try:
            while not self._closed:
                timeout = None
                if self._accept_again is not None:
                    timeout = max(0.0, self._accept_again - time.monotonic())
                    if timeout == 0.0:
                        self._accept_again = None
                        self._selector.register(self._sock, selectors.EVENT_READ, "accept")
                        timeout = None
                for key, events in self._selector.select(timeout):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        self._on_ready(key.data, events)
        except Exception as exc:  # noqa: BLE001 - a bug of ours: say so, stop cleanly
            log.error("the store at port %d stopped: %s: %s", self.port, type(exc).__name__, exc)
        finally:
            for key in list(self._selector.get_map().values()):
                if isinstance(key.data, _Conn):
                    key.data.sock.close()
            self._selector.close()
            self._sock.close()
            self._wake_r.close()
            self._wake_w.close()

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
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # answers are tiny: send each now
            except OSError:
                pass
            conn = _Conn(sock, f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer))
            self._selector.register(sock, conn.mask, conn)

    def _on_ready(self, conn: _Conn, events: int) -> None:
        if conn.closed:
            return
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
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
        conn.inbuf += data
        if len(conn.inbuf) < conn.need:
            return
        replies, pos, error, parsed = [], 0, None, None
        with self._lock:
            try:
                while pos < len(conn.inbuf):
                    parsed = parse_request(conn.inbuf, pos, conn.validated)
                    if isinstance(parsed, Need):
                        break
                    request, pos = parsed
                    conn.validated = True
                    replies += self._table.handle(conn, request)
            except WireError as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - a bug of ours: this client only pays for it
                error = f"{type(exc).__name__}: {exc}"
        conn.need = parsed.size if isinstance(parsed, Need) and error is None else 0
        del conn.inbuf[:pos]
        self._send(replies)
        if error is not None:
            log.warning("the store at port %d dropped the connection of %s: %s", self.port, conn.peer, error)
            self._drop(conn)

    def _send(self, replies) -> None:
        touched: dict[int, _Conn] = {}
        for conn, data in replies:
            if not conn.closed:
                conn.out += data
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
        mask = (selectors.EVENT_WRITE if conn.out else 0) | (selectors.EVENT_READ if len(conn.out) < _OUT_HIGH else 0)
        if mask != conn.mask:
            conn.mask = mask
            self._selector.modify(conn.sock, mask, conn)

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        with self._lock:
            self._table.forget(conn)
        self._selector.unregister(conn.sock)
        conn.sock.close()
