"""Shut a broken ring's connections in the order gloo survives: reads at once, the FIN later.

A gloo send can be lost when its connection breaks under it (torch 2.13's gloo,
``transport/tcp/pair.cc``): in async mode a ``writev`` that fails with EPIPE or ECONNRESET
leaves the operation in the pair's send queue and raises nothing, and when the pair then
reads the end of the stream and fails, it fails its pending receives and its bound
buffers, but not the unbound-buffer sends left in that queue. The caller waits in
``waitSend`` until the collective timeout. Two ways into that window, both measured with
2-4 gloo ranks all-reducing on a loaded 2-core host, each rank aborting its ring from
another thread, 20 s collective timeout:

- ``shutdown(SHUT_RDWR)`` of our own connections: a send issued between the shutdown and
  the moment gloo's event loop read the end of the stream failed with EPIPE. Every rank
  aborting at the same instant: 7 of 120 wakes took the whole timeout ("Timed out
  waiting 20000ms for send operation to complete").
- a peer's FIN, with our read side shut: Linux answers data that arrives at a socket in
  FIN_WAIT whose read side is shut with an RST, and the peer's next write fails with
  EPIPE before its event loop saw our FIN. Aborts 0-50 ms apart: 2 of 60.

This is the 60 s stall of reset rounds, where every worker aborts its ring as the new
plan reaches it. So a connection is shut in steps:

1. its read side (``SHUT_RD``), at once: gloo's event loop reads the end of the stream and
   fails the pair, after which every send of the pair raises; a send issued meanwhile
   still goes out, since nothing is shut for writing, and completes;
2. its write side (the FIN) only ``FIN_DELAY_S`` later, and once gloo has failed the pair
   (it closes its descriptor then; ``RELEASE_WAIT_S`` more at most, for a connection that
   is not gloo's: the round store's client closes nothing by itself). By then a peer of
   the same broken ring has aborted by itself (the plan that told us tells it; a worker
   that alone saw a fault asks for that plan), so no write of its can meet the RST. The
   FIN is the backstop for a peer that no plan reaches before its collective timeout;
   recovery never waits for it, since a new ring needs the new plan anyway.

A duplicate of each descriptor is held meanwhile, so that gloo's own close sends neither
an early FIN nor an RST (unread data); it is closed once the peer has closed its side
too, or ``LINGER_S`` after our FIN. One daemon thread per process does step 2 and the close for
every aborted ring.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

log = logging.getLogger(__name__)

FIN_DELAY_S = 2.0  # after the abort: the peers of a broken ring abort by themselves well within it
RELEASE_WAIT_S = 1.0  # gloo fails a pair within milliseconds; bounded for sockets that are not gloo's
LINGER_S = 5.0  # how long a peer may take to close its side before ours closes anyway
_POLL_S = 0.005
_TCP_CLOSED_STATES = frozenset({7, 6})  # TCP_CLOSE, TCP_TIME_WAIT (linux/tcp_states.h)


@dataclass
class _Held:
    fd: int  # the number the connection's owner (gloo) knows it by
    inode: int
    dup: socket.socket  # ours: keeps the connection open after the owner closes its number
    fin_at: float
    close_by: Optional[float] = None  # set once the write side is shut


def _released(held: _Held) -> bool:
    """Has the owner closed its descriptor (gloo does when it fails the pair)?"""
    try:
        return os.fstat(held.fd).st_ino != held.inode
    except OSError:
        return True


def _peer_closed(sock: socket.socket) -> bool:
    tcp_info = getattr(socket, "TCP_INFO", None)
    if tcp_info is None:  # not Linux: hold until the deadline
        return False
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, tcp_info, 1)[0] in _TCP_CLOSED_STATES
    except OSError:
        return True


class _Closer:
    """The thread that finishes what ``shut_reads`` began (step 2 and the close above)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: list[_Held] = []
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()

    def add(self, held: list[_Held]) -> None:
        with self._cond:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not ours
                self._held, self._thread, self._pid = [], None, os.getpid()
            self._held += held
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="elastic-ring-close", daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._held)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._held:
                    self._cond.wait()
                held = list(self._held)
            now = time.monotonic()
            done = [h for h in held if self._step(h, now)]
            if done:
                with self._cond:
                    self._held = [h for h in self._held if h not in done]
            time.sleep(_POLL_S)

    @staticmethod
    def _step(held: _Held, now: float) -> bool:
        """Advance one connection; True once its duplicate is closed."""
        if held.close_by is None:
            if now < held.fin_at or not (_released(held) or now >= held.fin_at + RELEASE_WAIT_S):
                return False
            try:
                held.dup.shutdown(socket.SHUT_WR)
            except OSError:  # reset by the peer meanwhile: nothing left to tell it
                pass
            held.close_by = now + LINGER_S
        if _peer_closed(held.dup) or now >= held.close_by:
            held.dup.close()
            return True
        return False


_closer = _Closer()


def shut_reads(connections: Iterable[Tuple[int, int]]) -> int:
    """Step 1 for each (fd, inode) that still names that socket; step 2 and the close
    follow on the closer's thread. How many were shut."""
    held = []
    for fd, inode in connections:
        dup = _duplicate_if_same(fd, inode)
        if dup is None:
            continue
        try:
            dup.shutdown(socket.SHUT_RD)
        except OSError:  # already reset by the peer: its owner sees the error by itself
            dup.close()
            continue
        held.append(_Held(fd, inode, dup, time.monotonic() + FIN_DELAY_S))
    if held:
        _closer.add(held)
    return len(held)


def pending() -> int:
    """Connections whose write side or duplicate is not closed yet (for tests)."""
    return _closer.pending()


def _duplicate_if_same(fd: int, inode: int) -> Optional[socket.socket]:
    """A socket on a duplicate of ``fd`` if it still names socket ``inode``, else None.
    Checking on the duplicate pins the socket: no reuse of the number can slip in between
    the check and the shutdown. The number may name something else by now (a file, a
    pipe), so look before wrapping it in a socket."""
    try:
        dup_fd = os.dup(fd)
    except OSError:  # closed already
        return None
    try:
        if os.fstat(dup_fd).st_ino != inode:
            os.close(dup_fd)
            return None
        return socket.socket(fileno=dup_fd)
    except OSError:  # not a socket after all: the wrapper did not take the number
        os.close(dup_fd)
        return None
