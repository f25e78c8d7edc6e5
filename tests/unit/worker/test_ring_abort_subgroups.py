"""ring_abort: process groups cut out of a ring after it formed (a hybrid mesh's lines) are aborted with it."""

import socket

from elastic.worker import ring_abort


def _tcp_pair():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return listener, client, server


def test_an_abort_shuts_the_connections_included_after_the_ring_formed():
    before = ring_abort.socket_snapshot()
    ring = _tcp_pair()
    handle = ring_abort.RingHandle(ring_abort._connections_since(before))
    later = ring_abort.socket_snapshot()
    sub = _tcp_pair()  # a sub-group's connection, made once the ring exists
    try:
        handle.include_since(later)
        handle.abort()
        for peer in (ring[2], sub[2]):
            peer.settimeout(2)
            assert peer.recv(1) == b""  # shut down: end of stream
    finally:
        for s in (*ring, *sub):
            s.close()


def test_connections_included_after_an_abort_are_shut_at_once():
    handle = ring_abort.RingHandle(frozenset())
    handle.abort()
    later = ring_abort.socket_snapshot()
    sub = _tcp_pair()
    try:
        handle.include_since(later)
        sub[2].settimeout(2)
        assert sub[2].recv(1) == b""
    finally:
        for s in sub:
            s.close()


def test_a_planned_leave_or_a_forgotten_ring_shuts_nothing_more():
    for make in ("planned", "forgotten"):
        handle = ring_abort.RingHandle(frozenset())
        if make == "planned":
            handle.abort(sockets=False)
        else:
            handle.forget()
        later = ring_abort.socket_snapshot()
        sub = _tcp_pair()
        try:
            handle.include_since(later)
            sub[2].settimeout(0.2)
            sub[1].sendall(b"x")
            assert sub[2].recv(1) == b"x"  # still connected
        finally:
            for s in sub:
                s.close()
