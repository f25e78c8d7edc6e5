"""ring_abort: a gloo collective blocked on a live but silent peer raises at once."""

import datetime
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from elastic.worker import ring_abort

# Rank 1 joins the group, then stays alive without ever entering a collective: rank 0's
# all_reduce waits on a healthy socket, which is what a non-neighbour of a dead rank sees.
_SILENT_PEER = """
import datetime, sys, time, torch.distributed as dist
store = dist.FileStore(sys.argv[1], 2)
dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=datetime.timedelta(seconds=60))
time.sleep(60)
"""


def _tcp_pair():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return listener, client, server


def test_connections_since_skips_listeners_and_older_sockets():
    old = _tcp_pair()
    before = ring_abort.socket_snapshot()
    listener, client, server = _tcp_pair()
    try:
        found = {fd for fd, _ in ring_abort._connections_since(before)}
        assert found == {client.fileno(), server.fileno()}
    finally:
        for s in (*old, listener, client, server):
            s.close()


def test_abort_shuts_connections_and_ignores_reused_descriptors():
    before = ring_abort.socket_snapshot()
    listener, client, server = _tcp_pair()
    connections = ring_abort._connections_since(before)
    assert len(connections) == 2
    handle = ring_abort.RingHandle(connections)
    other_listener = socket.create_server(("127.0.0.1", 0))
    client_fd = client.fileno()
    client.close()  # POSIX hands out the lowest free number: the next socket reuses it
    other = socket.create_connection(other_listener.getsockname())
    other_peer, _ = other_listener.accept()
    try:
        assert other.fileno() == client_fd
        handle.abort()
        server.settimeout(2)
        assert server.recv(1) == b""  # shut down: end of stream, not a timeout
        assert handle.aborted
        other_peer.settimeout(0.2)
        with pytest.raises(socket.timeout):  # the reused number was left alone
            other_peer.recv(1)
    finally:
        for s in (listener, server, other_listener, other, other_peer):
            s.close()


def test_abort_leaves_a_descriptor_reused_by_something_that_is_no_socket():
    # Seen in a sharded job: the number of a gloo connection closed meanwhile named a
    # file when the abort came, and wrapping it in a socket raised ENOTSOCK.
    before = ring_abort.socket_snapshot()
    listener, client, server = _tcp_pair()
    handle = ring_abort.RingHandle(ring_abort._connections_since(before))
    client_fd = client.fileno()
    client.close()
    read_end, write_end = os.pipe()  # the lowest free number again: a pipe now
    try:
        assert client_fd in (read_end, write_end)
        handle.abort()  # no OSError
        server.settimeout(2)
        assert server.recv(1) == b""
        os.write(write_end, b"x")
        assert os.read(read_end, 1) == b"x"  # the pipe still works
    finally:
        os.close(read_end)
        os.close(write_end)
        for s in (listener, server):
            s.close()


def test_prepare_ring_rejects_missing_snapshot():
    with pytest.raises(TypeError, match="SocketSnapshot"):
        ring_abort.prepare_ring(before=None)


@pytest.mark.timeout(60)
def test_abort_wakes_collective_blocked_on_silent_peer(tmp_path):
    path = str(tmp_path / "store")
    peer = subprocess.Popen([sys.executable, "-c", _SILENT_PEER, path])
    try:
        before = ring_abort.socket_snapshot()
        dist.init_process_group(
            "gloo", store=dist.FileStore(path, 2), rank=0, world_size=2,
            timeout=datetime.timedelta(seconds=30),
        )
        assert len(ring_abort._connections_since(before)) >= 1  # gloo's pairs: what the handle shuts
        handle = ring_abort.prepare_ring(before=before)
        # Abort once the collective is issued and the main thread waits for it (dist.all_reduce
        # calls work.wait(), seen by a profile hook), not after a guessed delay.
        waiting = threading.Event()
        aborted_at: list[float] = []

        def on_call(frame, event, arg) -> None:
            if event == "c_call" and getattr(arg, "__name__", "") == "wait":
                waiting.set()

        def abort_when_waiting() -> None:
            if waiting.wait(20):
                aborted_at.append(time.monotonic())
                handle.abort()

        aborter = threading.Thread(target=abort_when_waiting, daemon=True)
        aborter.start()
        sys.setprofile(on_call)
        try:
            with pytest.raises(RuntimeError, match="(?i)connection closed"):
                dist.all_reduce(torch.ones(1000))
        finally:
            sys.setprofile(None)
        raised_at = time.monotonic()
        aborter.join(5)
        assert aborted_at, "the collective never reached work.wait()"
        assert raised_at - aborted_at[0] < 5  # the collective timeout is 30 s
        with pytest.raises(RuntimeError):  # later collectives fail too
            dist.all_reduce(torch.ones(3))
        handle.forget()
        dist.destroy_process_group()
        # A new group works in the same process.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        x = torch.ones(3)
        dist.all_reduce(x)
        assert x.tolist() == [1.0, 1.0, 1.0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        peer.kill()
        peer.wait(10)
