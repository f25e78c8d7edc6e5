"""The agent's store server: served from the moment its port is known, bound to the
job's address only, and robust against what a peer can send. Clients here are raw
sockets speaking the wire format (store_wire.py), so no torch in this process
(test_store_protocol.py has torch's own client)."""

from __future__ import annotations

import socket
import struct

import pytest

from elastic.agent.store_server import StoreServer
from elastic.agent.store_wire import MAX_KEY_LEN, MAX_VALUE_LEN, VALIDATION_MAGIC, Query, request

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    server = StoreServer("127.0.0.1")
    yield server
    server.close()


class Client:
    """A client as torch's connects: VALIDATE, then PING with a nonce."""

    def __init__(self, port: int, validate: bool = True):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if validate:
            self.send(request(Query.VALIDATE, VALIDATION_MAGIC) + request(Query.PING, 1234))
            assert self.recv(4) == struct.pack("=I", 1234)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError(f"closed after {len(data)} of {size} bytes")
            data += chunk
        return data

    def get(self, key: bytes) -> bytes:
        self.send(request(Query.GET, key))
        return self.recv(struct.unpack("=Q", self.recv(8))[0])

    def closed_by_server(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def test_a_client_that_connects_at_once_is_served_and_the_agent_prunes_in_process(server):
    client = Client(server.port)  # no start(): it serves from the constructor on
    # Keys as torch's client writes them: "/" before the key a user (a PrefixStore) names.
    client.send(request(Query.SET, b"//round/1/k", b"v") + request(Query.SET, b"/job", b"x")
                + request(Query.SET, b"init/", b"1"))
    assert client.get(b"//round/1/k") == b"v"
    store = server.started()
    assert sorted(store.list_keys()) == ["/round/1/k", "job"]  # torch's view: its "/" prefix off
    assert store.delete_key("/round/1/k") and not store.delete_key("/round/1/k")
    client.send(request(Query.CHECK, [b"//round/1/k"]))
    assert client.recv(1) == b"\x01"  # NOT_READY
    client.close()


def test_the_store_listens_on_the_given_address_only(server):
    other = socket.socket()
    other.settimeout(2)
    # Another local address of this host (127.0.0.2 is loopback too): nothing there.
    with pytest.raises(OSError):
        other.connect(("127.0.0.2", server.port))
    other.close()
    Client(server.port).close()


def test_an_address_this_host_does_not_hold_falls_back_to_every_interface(caplog):
    server = StoreServer("192.0.2.1")  # TEST-NET-1: never a local address
    try:
        assert "listens on every interface" in caplog.text
        Client(server.port).close()  # reached through loopback
    finally:
        server.close()


def test_closed_the_port_is_released_and_its_thread_ends():
    server = StoreServer("127.0.0.1")
    client = Client(server.port)
    server.close()
    assert server.started() is None and not server._thread.is_alive()
    assert client.closed_by_server()
    probe = socket.socket()
    probe.settimeout(2)
    with pytest.raises(OSError):
        probe.connect(("127.0.0.1", server.port))
    probe.close()


@pytest.mark.parametrize("garbage", ids=["http", "wrong-magic", "unvalidated"], argvalues=[
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # a probe or a scanner, before validation
    request(Query.VALIDATE, 0xDEADBEEF),  # the wrong magic number
    request(Query.SET, b"k", b"v"),  # a request before validation
])
def test_a_peer_that_does_not_validate_loses_its_connection_and_only_it(server, garbage, caplog):
    good = Client(server.port)
    bad = Client(server.port, validate=False)
    bad.send(garbage)
    assert bad.closed_by_server()
    assert "dropped the connection" in caplog.text
    good.send(request(Query.SET, b"k", b"still served"))
    assert good.get(b"k") == b"still served"


@pytest.mark.parametrize("garbage", ids=["type", "validate-twice", "key-len", "value-len", "huge-len", "key-count",
                                         "add-to-text"], argvalues=[
    bytes([200]),  # an unknown query type
    request(Query.VALIDATE, VALIDATION_MAGIC),  # a second validation
    struct.pack("=BQ", Query.GET, MAX_KEY_LEN + 1),  # a key over torch's 8 KiB: refused before it comes
    struct.pack("=BQ", Query.SET, 3) + b"key" + struct.pack("=Q", MAX_VALUE_LEN + 1),  # a value over 8 MiB
    struct.pack("=BQ", Query.SET, 1 << 62),  # a length that would exhaust memory
    struct.pack("=BQ", Query.WAIT, 10 ** 9),  # too many keys
    request(Query.SET, b"n", b"not a number") + request(Query.ADD, b"n", 1),  # a counter that is not one
])
def test_a_validated_peer_that_sends_garbage_loses_its_connection_and_the_server_goes_on(server, garbage):
    good, bad = Client(server.port), Client(server.port)
    bad.send(garbage)
    assert bad.closed_by_server()
    good.send(request(Query.SET, b"k", b"v"))
    assert good.get(b"k") == b"v"


def test_a_request_in_pieces_is_answered_once_it_is_whole(server):
    client = Client(server.port)
    data = request(Query.SET, b"split", b"x" * 100_000) + request(Query.GET, b"split")
    for start in range(0, len(data), 7001):
        client.send(data[start:start + 7001])
    assert struct.unpack("=Q", client.recv(8))[0] == 100_000
    assert client.recv(100_000) == b"x" * 100_000


def test_a_client_gone_mid_wait_is_forgotten_and_the_others_are_woken(server):
    gone, waiter, setter = Client(server.port), Client(server.port), Client(server.port)
    gone.send(request(Query.WAIT, [b"late"]))
    waiter.send(request(Query.WAIT, [b"late", b"also"]))
    gone.close()  # a worker killed while it waited
    setter.send(request(Query.SET, b"late", b"1") + request(Query.SET, b"also", b"2"))
    assert waiter.recv(1) == b"\x00"  # STOP_WAITING
    assert setter.get(b"late") == b"1"


def test_a_cancelled_wait_is_answered_once(server):
    client, setter = Client(server.port), Client(server.port)
    client.send(request(Query.WAIT, [b"never"]) + request(Query.CANCEL_WAIT))
    assert client.recv(1) == b"\x01"  # WAIT_CANCELED
    setter.send(request(Query.SET, b"never", b"now"))
    assert setter.get(b"never") == b"now"  # the set is done
    assert client.get(b"never") == b"now"  # and no stale STOP_WAITING came before this answer


# -- bounds on every peer (security review 2: H3, M5, L6) ----------------------------------
def _wait(predicate, timeout=10.0):
    import time
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_pipelined_gets_never_read_stop_at_the_answer_bound(server):
    # 40 GETs of a 1 MiB value in one packet, answers never read: before, every answer of
    # the read buffer was built (N x the value; 1000 x 8 MiB took the store down).
    from elastic.agent import store_server
    client, other = Client(server.port), Client(server.port)
    client.send(request(Query.SET, b"big", b"v" * (1 << 20)))
    client.send(b"".join(request(Query.GET, b"big") for _ in range(40)))
    assert _wait(lambda: server._buffered > 0)
    other.send(request(Query.PING, 7))  # the store still answers others at once
    assert other.recv(4) == struct.pack("=I", 7)
    assert server._buffered <= store_server._OUT_HIGH + 2 * (1 << 20) + (1 << 16), server._buffered
    # Once the peer reads, the rest of its requests are answered, every one of them.
    total = 40 * (8 + (1 << 20))
    assert len(client.recv(total)) == total


def test_connections_are_capped_in_all_and_per_address(monkeypatch):
    from elastic.agent import store_server
    monkeypatch.setattr(store_server, "MAX_PER_ADDRESS", 6)
    server = StoreServer("127.0.0.1", max_connections=10)
    try:
        local = [Client(server.port) for _ in range(6)]
        # A seventh from the same address is closed at once; another address still gets in.
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        assert extra.recv(1) == b""
        other_address = [socket.create_connection(("127.0.0.1", server.port), timeout=5, source_address=("127.0.0.2", 0))
                         for _ in range(4)]
        assert _wait(lambda: server.connections == 10)
        over = socket.create_connection(("127.0.0.1", server.port), timeout=5, source_address=("127.0.0.3", 0))
        assert over.recv(1) == b""  # over the cap in all
        local[0].close()
        assert _wait(lambda: server.connections == 9)
        Client(server.port).close()  # a slot freed is a slot taken again
    finally:
        server.close()


def test_a_connection_that_does_not_validate_in_time_is_closed(monkeypatch):
    from elastic.agent import store_server
    monkeypatch.setattr(store_server, "VALIDATE_S", 0.3)
    monkeypatch.setattr(store_server, "_SWEEP_S", 0.1)
    server = StoreServer("127.0.0.1")
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(20)]
        good = Client(server.port)
        for sock in idle:
            assert sock.recv(1) == b""  # closed by the server, not left to hold a descriptor
        assert _wait(lambda: server.connections == 1)
        assert good.get(b"nothing") == b""  # a validated idle client is kept: workers idle for hours
    finally:
        server.close()


def test_a_peer_that_leaves_its_answers_unread_is_dropped(monkeypatch):
    from elastic.agent import store_server
    monkeypatch.setattr(store_server, "STALLED_S", 0.3)
    monkeypatch.setattr(store_server, "_SWEEP_S", 0.1)
    server = StoreServer("127.0.0.1")
    try:
        client = Client(server.port)
        client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.send(request(Query.SET, b"big", b"v" * (1 << 20)) + request(Query.GET, b"big") * 8)
        assert _wait(lambda: server.connections == 0)
        assert server._buffered == 0
    finally:
        server.close()


def test_a_request_announcing_more_than_the_cap_is_refused_before_it_comes(server):
    from elastic.agent.store_wire import MAX_REQUEST_LEN
    bad = Client(server.port)
    # Keys of 8 KiB each, as many as fit below MAX_KEY_COUNT: the sum passes the cap.
    header = struct.pack("=BQ", Query.MULTI_GET, 128 * 1024)
    key = struct.pack("=Q", MAX_KEY_LEN) + b"k" * MAX_KEY_LEN
    sent = len(header)
    bad.send(header)
    try:
        while sent < MAX_REQUEST_LEN + 2 * len(key):
            bad.send(key)
            sent += len(key)
    except OSError:
        pass  # closed while we sent: what the test wants
    assert bad.closed_by_server()
    assert server._buffered == 0


def test_a_memory_error_serving_one_peer_drops_that_peer_only(server, monkeypatch):
    table = server._table
    handle = table.handle

    def failing(conn, req):
        if req.keys and req.keys[0] == b"boom":
            raise MemoryError("no memory for this one")
        return handle(conn, req)

    monkeypatch.setattr(table, "handle", failing)
    bad, good = Client(server.port), Client(server.port)
    bad.send(request(Query.GET, b"boom"))
    assert bad.closed_by_server()
    good.send(request(Query.SET, b"k", b"v"))
    assert good.get(b"k") == b"v"
    assert server.started() is server


def test_a_loop_that_keeps_failing_stops_loudly_and_tells_its_owner(monkeypatch, caplog):
    from elastic.agent import store_server
    monkeypatch.setattr(store_server, "_SWEEP_S", 0.01)
    told = []
    server = StoreServer("127.0.0.1", on_failure=told.append)
    monkeypatch.setattr(server, "_sweep", lambda: (_ for _ in ()).throw(MemoryError("the sweep")))
    try:
        assert _wait(lambda: told, 10)
        assert told == ["MemoryError: the sweep"]
        assert server.started() is None  # the agent's pruning and member record see it gone
        assert "stopped: MemoryError: the sweep" in caplog.text
        assert caplog.text.count("serving again") == store_server._RESTARTS
    finally:
        server.close()


def test_dropped_connections_are_logged_once_a_minute_per_address(server, caplog):
    for _ in range(30):
        bad = Client(server.port, validate=False)
        bad.send(b"junk")
        assert bad.closed_by_server()
        bad.close()
    lines = [r for r in caplog.records if "dropped the connection" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    bad = Client(server.port, validate=False)
    bad.send(b"junk")
    assert bad.closed_by_server()
    server._dropped["127.0.0.1"] = (server._dropped["127.0.0.1"][0] - 61, server._dropped["127.0.0.1"][1])
    bad = Client(server.port, validate=False)
    bad.send(b"junk")
    assert bad.closed_by_server()
    lines = [r.getMessage() for r in caplog.records if "dropped the connection" in r.getMessage()]
    assert len(lines) == 2 and "30 more from 127.0.0.1" in lines[1], lines
