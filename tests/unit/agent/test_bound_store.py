"""The agent's stores listen on the job's address only (security review, finding 2).

On Linux all of 127.0.0.0/8 is loopback: a server bound to every interface (what
``TCPStore("0.0.0.0", ...)`` does) accepts a connection to 127.0.0.2, one bound to
127.0.0.1 refuses it. So no second interface is needed to tell the two apart.
"""

import datetime
import socket

import pytest
import torch.distributed as dist

from elastic.agent import bound_store


def _connects(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_the_round_store_serves_its_address_and_nothing_else():
    store = bound_store.serve("127.0.0.1", 10)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    client.set("switch_at", "3 switch")
    assert store.get("switch_at") == b"3 switch"
    assert not _connects("127.0.0.2", store.port)


def test_the_wildcard_store_of_before_was_reachable_on_any_address():
    # What the test above rules out, shown to be observable here.
    store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
    assert _connects("127.0.0.2", store.port)


def test_a_store_gives_its_port_back_when_dropped():
    store = bound_store.serve("127.0.0.1", 10)
    port = store.port
    del store
    assert not _connects("127.0.0.1", port)


def test_an_address_this_host_does_not_hold_is_an_error():
    with pytest.raises(OSError):
        bound_store.serve("192.0.2.1", 10)  # TEST-NET-1: never a local address
