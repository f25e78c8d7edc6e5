"""The TCPStore wire format (store_wire.py) as tables: bytes in, request out."""

from __future__ import annotations

import struct

import pytest

from elastic.agent.store_wire import (MAX_KEY_COUNT, MAX_KEY_LEN, MAX_VALUE_LEN, VALIDATION_MAGIC, Need, Query,
                                      Request, WireError, blob, parse_request, request)


def _q(value: int) -> bytes:
    return struct.pack("=Q", value)


# The bytes as torch 2.13's client writes them (host byte order; lengths 64-bit).
PARSED = [
    (bytes([0]) + struct.pack("=I", VALIDATION_MAGIC), False, Request(Query.VALIDATE, number=VALIDATION_MAGIC)),
    (bytes([13]) + struct.pack("=I", 4242), True, Request(Query.PING, number=4242)),
    (bytes([1]) + _q(2) + b"/k" + _q(3) + b"val", True, Request(Query.SET, (b"/k",), (b"val",))),
    (bytes([1]) + _q(2) + b"/k" + _q(0), True, Request(Query.SET, (b"/k",), (b"",))),
    (bytes([2]) + _q(1) + b"k" + _q(0) + _q(1) + b"n", True, Request(Query.COMPARE_SET, (b"k",), (b"", b"n"))),
    (bytes([3]) + _q(1) + b"k", True, Request(Query.GET, (b"k",))),
    (bytes([4]) + _q(1) + b"k" + struct.pack("=q", -3), True, Request(Query.ADD, (b"k",), number=-3)),
    (bytes([5]) + _q(2) + _q(1) + b"a" + _q(1) + b"b", True, Request(Query.CHECK, (b"a", b"b"))),
    (bytes([6]) + _q(0), True, Request(Query.WAIT)),
    (bytes([7]), True, Request(Query.GETNUMKEYS)),
    (bytes([8]) + _q(1) + b"k", True, Request(Query.DELETE_KEY, (b"k",))),
    (bytes([9]) + _q(1) + b"k" + _q(1) + b"+", True, Request(Query.APPEND, (b"k",), (b"+",))),
    (bytes([10]) + _q(1) + _q(1) + b"a", True, Request(Query.MULTI_GET, (b"a",))),
    (bytes([11]) + struct.pack("=q", 2) + _q(1) + b"a" + _q(1) + b"1" + _q(1) + b"b" + _q(1) + b"2", True,
     Request(Query.MULTI_SET, (b"a", b"b"), (b"1", b"2"))),
    (bytes([12]), True, Request(Query.CANCEL_WAIT)),
    (bytes([14]) + _q(1) + b"q" + _q(1) + b"x", True, Request(Query.QUEUE_PUSH, (b"q",), (b"x",))),
    (bytes([15]) + _q(1) + b"q", True, Request(Query.QUEUE_POP, (b"q",))),
    (bytes([16]) + _q(1) + b"q", True, Request(Query.QUEUE_LEN, (b"q",))),
    (bytes([17]), True, Request(Query.LIST_KEYS)),
    (bytes([18]) + _q(1) + b"b" + struct.pack("=q", 4), True, Request(Query.BARRIER, (b"b",), number=4)),
]


@pytest.mark.parametrize("data, validated, expected", PARSED, ids=[row[2].query.name for row in PARSED])
def test_each_request_parses_from_torchs_bytes_at_any_offset(data, validated, expected):
    assert parse_request(data + b"next", 0, validated) == (expected, len(data))
    assert parse_request(b"xx" + data, 2, validated) == (expected, 2 + len(data))


@pytest.mark.parametrize("data, validated, expected", PARSED, ids=[row[2].query.name for row in PARSED])
def test_every_cut_of_a_request_asks_for_more_and_never_for_more_than_it_needs(data, validated, expected):
    for cut in range(len(data)):
        need = parse_request(data[:cut], 0, validated)
        assert isinstance(need, Need) and cut < need.size <= len(data), (cut, need)


def test_the_encoder_writes_what_the_parser_reads():
    data = (request(Query.VALIDATE, VALIDATION_MAGIC) + request(Query.MULTI_SET, [(b"a", b"1")])
            + request(Query.WAIT, [b"a", b"b"]) + request(Query.COMPARE_SET, b"k", b"", b"v"))
    requests, pos, validated = [], 0, False
    while pos < len(data):
        req, pos = parse_request(data, pos, validated)
        requests.append(req)
        validated = True
    assert requests == [Request(Query.VALIDATE, number=VALIDATION_MAGIC), Request(Query.MULTI_SET, (b"a",), (b"1",)),
                        Request(Query.WAIT, (b"a", b"b")), Request(Query.COMPARE_SET, (b"k",), (b"", b"v"))]
    assert blob(b"ab") == _q(2) + b"ab"


REFUSED = [
    (bytes([19]), True, "unknown query type 19"),
    (bytes([255]), True, "unknown query type 255"),
    (bytes([1]) + _q(1) + b"k" + _q(1) + b"v", False, "before validation"),
    (bytes([0]) + struct.pack("=I", VALIDATION_MAGIC), True, "second validation"),
    (bytes([0]) + struct.pack("=I", 1), False, "wrong magic"),
    (bytes([3]) + _q(MAX_KEY_LEN + 1), True, "a key of 8193 bytes"),  # refused before its bytes come
    (bytes([1]) + _q(1) + b"k" + _q(MAX_VALUE_LEN + 1), True, "a value of"),
    (bytes([1]) + _q(1 << 63), True, "a key of"),
    (bytes([6]) + _q(MAX_KEY_COUNT + 1), True, "keys in one request"),
    (bytes([11]) + struct.pack("=q", -1), True, "keys in one request"),
]


@pytest.mark.parametrize("data, validated, message", REFUSED, ids=[row[2] for row in REFUSED])
def test_what_torchs_client_never_sends_is_refused_at_once(data, validated, message):
    with pytest.raises(WireError, match=message):
        parse_request(data, 0, validated)


def test_a_key_at_the_cap_is_a_key():
    key = b"k" * MAX_KEY_LEN
    assert parse_request(request(Query.GET, key))[0] == Request(Query.GET, (key,))


def test_a_request_in_many_pieces_costs_its_length_once(monkeypatch):
    # A 4088-key MULTI_SET streamed in 64 KiB pieces was parsed again from its start at
    # every piece: 32 MiB cost 7.9 s of the store's one thread (security review 2, M5).
    from elastic.agent import store_wire
    from elastic.agent.store_wire import RequestParser
    calls = []
    sized = store_wire._sized
    monkeypatch.setattr(store_wire, "_sized", lambda *a: calls.append(1) or sized(*a))
    pairs = [(b"k%05d" % n, b"v" * 1000) for n in range(2000)]
    data = request(Query.MULTI_SET, pairs)
    parser, buf = RequestParser(), bytearray()
    for start in range(0, len(data), 4096):
        buf += data[start:start + 4096]
        parsed = parser.feed(buf, 0)
    assert parsed == (Request(Query.MULTI_SET, tuple(k for k, _ in pairs), tuple(v for _, v in pairs)), len(data))
    pieces = len(data) // 4096 + 1
    assert len(calls) <= 2 * len(pairs) + pieces, (len(calls), pieces)  # each field once, plus one retry a piece


def test_a_request_announcing_more_than_the_cap_is_refused_at_once():
    from elastic.agent.store_wire import MAX_REQUEST_LEN
    head = struct.pack("=BQ", Query.SET, 8) + b"key-name" + struct.pack("=Q", MAX_VALUE_LEN)
    assert isinstance(parse_request(head), Need)  # one whole value: fine
    many = struct.pack("=BQ", Query.MULTI_SET, 5)
    pair = struct.pack("=Q", 1) + b"k" + struct.pack("=Q", MAX_VALUE_LEN) + b"v" * MAX_VALUE_LEN
    with pytest.raises(WireError, match="a request of at least"):
        parse_request(many + pair * 4 + struct.pack("=Q", 1) + b"k" + struct.pack("=Q", MAX_VALUE_LEN))
