"""A TCPStore that an agent serves: its port is known at once, torch is loaded later.

An agent serves two kinds of store (the round store its member record advertises, and a
fresh store per round for torchrun-style scripts: plain_store.py). Both are torch's
``TCPStore`` and importing torch takes 1.4 s of every ``elastic-run`` start on an idle
2-core host. The port is all the agent needs to register and to start its workers, and
a worker connects only after importing torch itself. So the agent binds and listens on
a socket here, advertises its port, and once its workers are started a thread imports
torch and hands the socket to ``TCPStore(master_listen_fd=...)``: a client that connects
before that waits in the listen backlog and is served once the store is up (torch 2.13,
libuv backend).

The socket is bound to the job's address (``--host-addr``), not to every interface:
torch's store server binds the wildcard address whatever host it is given, and the store
has no authentication while its keys decide switches and stops (security review, finding
2), so only the job's network should reach it. Where this host does not hold that address (NAT,
where peers reach us through a translated one) it falls back to every interface, and
says so once.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from typing import Optional

log = logging.getLogger(__name__)

_BACKLOG = 512  # every worker of a large job may connect before the store is up


def _listening_socket(addr: str) -> tuple[socket.socket, str]:
    """A listening socket on ``addr`` (or every interface), and the address at which
    this process reaches it: torch's store connects a client of its own to it."""
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
            local = addr
        except OSError as exc:
            log.warning("the store cannot bind %s (%s): it listens on every interface", addr, exc)
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
            local = "::1" if family == socket.AF_INET6 else "127.0.0.1"
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock, local


class StoreServer:
    """One TCPStore server: ``port`` now, ``store()`` once torch has started it."""

    def __init__(self, addr: str, timeout: float, name: str = "store"):
        self._sock: Optional[socket.socket]
        self._sock, self._local_addr = _listening_socket(addr)
        self.addr = addr
        self.port: int = self._sock.getsockname()[1]
        self._timeout = timeout
        self._store = None
        self._error: Optional[BaseException] = None
        self._ready = threading.Event()
        self._lock = threading.Lock()  # the socket changes hands once: to the store, or closed
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"{name}-server", daemon=True)

    def start(self) -> "StoreServer":
        """Start serving (once). The agent calls this after starting its workers: the
        C part of importing torch holds the GIL for long stretches, and done earlier it
        delayed the agent's own etcd calls (the election, the first round) by up to
        0.45 s; a worker connects only after its own import of torch anyway."""
        with self._lock:
            if not self._thread.is_alive() and not self._ready.is_set() and not self._closed:
                self._thread.start()
        return self

    def _serve(self) -> None:
        try:
            import torch.distributed as dist  # the slow part, off the start path

            with self._lock:
                if self._closed:
                    return
                # The store owns (and closes) the descriptor it is given: it gets a copy,
                # and ours closes here whether it started or not, so no descriptor is
                # ever closed twice.
                fd = os.dup(self._sock.fileno())
                try:
                    self._store = dist.TCPStore(
                        self._local_addr, self.port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                        timeout=datetime.timedelta(seconds=self._timeout),
                    )
                finally:
                    self._sock.close()
                    self._sock = None
        except BaseException as exc:  # noqa: BLE001 - reported to whoever asks for the store
            self._error = exc
            log.error("the store at port %d could not start: %s", self.port, exc)
        finally:
            self._ready.set()

    def store(self, timeout: Optional[float] = None):
        """The running TCPStore (waits for it, bounded by ``timeout`` or the store's own)."""
        if not self._ready.wait(self._timeout if timeout is None else timeout):
            raise TimeoutError(f"the store at port {self.port} did not start within {timeout or self._timeout:g}s")
        if self._error is not None:
            raise RuntimeError(f"the store at port {self.port} could not start: {self._error}") from self._error
        return self._store

    def started(self):
        """The TCPStore if it is up, else None (never waits)."""
        return self._store if self._ready.is_set() else None

    def close(self) -> None:
        """Stop serving, without waiting for a store still starting (it will not)."""
        with self._lock:
            self._closed = True
            self._store = None  # the last reference: the store's server closes
            if self._sock is not None:
                self._sock.close()
                self._sock = None
