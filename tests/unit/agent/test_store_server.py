"""The agent's store server: a port at once, torch's TCPStore behind it later, bound to
the job's address only."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch.distributed as dist

from elastic.agent.store_server import StoreServer


def _client(port: int, timeout: float = 10.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def test_a_client_that_connects_before_the_store_starts_is_served_once_it_does():
    server = StoreServer("127.0.0.1", timeout=10.0)
    got = {}

    def early_client():
        client = _client(server.port)
        got["value"] = client.get("key")  # waits for the key: set only after start()

    thread = threading.Thread(target=early_client)
    thread.start()
    try:
        store = server.start().store(timeout=30)
        store.set("key", "from the agent")
        thread.join(30)
        assert got == {"value": b"from the agent"}
    finally:
        server.close()


def test_the_store_listens_on_the_given_address_only():
    server = StoreServer("127.0.0.1", timeout=10.0).start()
    try:
        server.store(timeout=30)
        listening = socket.socket()
        # Another local address of this host (127.0.0.2 is loopback too): nothing there.
        with pytest.raises(OSError):
            listening.settimeout(2)
            listening.connect(("127.0.0.2", server.port))
        listening.close()
        _client(server.port).set("k", "v")
    finally:
        server.close()


def test_an_address_this_host_does_not_hold_falls_back_to_every_interface(caplog):
    server = StoreServer("192.0.2.1", timeout=10.0)  # TEST-NET-1: never a local address
    try:
        assert "listens on every interface" in caplog.text
        server.start().store(timeout=30)
        _client(server.port).set("k", "v")  # reached through loopback
    finally:
        server.close()


def test_closed_before_it_started_the_port_is_released_and_nothing_starts():
    server = StoreServer("127.0.0.1", timeout=10.0)
    port = server.port
    server.close()
    server.start()  # a no-op once closed
    assert server.started() is None
    probe = socket.socket()
    probe.settimeout(2)
    with pytest.raises(OSError):
        probe.connect(("127.0.0.1", port))
    probe.close()
