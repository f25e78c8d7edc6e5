"""The bytes torch's TCPStore client and server exchange, read and written without torch.

The agent serves its stores itself (store_server.py) so that ``elastic-run`` never
imports torch; its workers, torch's process groups (gloo's and NCCL's rendezvous) and
torchrun-style ``env://`` scripts connect with torch's own C++ client, unchanged. The
facts below are those of torch 2.13's client (``TCPStore.cpp``) and libuv server
(``TCPStoreLibUvBackend.cpp``), checked against the installed binary by
``tests/unit/agent/test_store_protocol.py``:

- A request is one byte of query type, then its fields; nothing marks its end.
- Integers are in the host's byte order (torch writes them from memory); a string or a
  value is a 64-bit length, then its bytes; a count of keys is 64 bits.
- A connection's first request is VALIDATE with a 32-bit magic number, unanswered;
  the client then sends PING with a nonce that the server echoes.
- SET, APPEND, MULTI_SET and QUEUE_PUSH are unanswered; WAIT (and BARRIER) are answered
  only when the keys are there, or with WAIT_CANCELED after the client's CANCEL_WAIT.

Sizes are checked before anything is kept, with torch's own caps: a peer that sends a
key over 8 KiB, a value over 8 MiB, more than 128 Ki keys in one request, an unknown
query type, or anything before VALIDATE, loses its connection (``WireError``).
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple, Union

VALIDATION_MAGIC = 0x3C85F7CE
MAX_KEY_LEN = 8 * 1024  # torch's MAX_STRING_LEN
MAX_VALUE_LEN = 8 * 1024 * 1024  # torch's MAX_PAYLOAD_LEN
MAX_KEY_COUNT = 128 * 1024

_U8 = struct.Struct("=B")
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_I64 = struct.Struct("=q")


class Query(enum.IntEnum):
    """torch 2.13's QueryType, in its order (the byte on the wire)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


READY, NOT_READY = 0, 1  # CHECK's answer
STOP_WAITING, WAIT_CANCELED = 0, 1  # WAIT's, BARRIER's and CANCEL_WAIT's answer


class WireError(ValueError):
    """The peer sent something torch's client never sends: drop its connection."""


class Request(NamedTuple):
    query: Query
    keys: tuple = ()  # bytes each
    values: tuple = ()  # SET/APPEND/QUEUE_PUSH: one; COMPARE_SET: expected, desired; MULTI_SET: one a key
    number: int = 0  # ADD's delta, BARRIER's world size, PING's nonce, VALIDATE's magic


class Need(NamedTuple):
    """The request is not all there: at least ``size`` bytes from its start are needed
    before parsing again is worth it."""

    size: int


# The fields of each query, in order: "k" a key, "v" a value, "q" a signed 64-bit number,
# "u" an unsigned 32-bit one, "K" a count then that many keys, "S" a count then that many
# key-value pairs.
_FIELDS = {
    Query.VALIDATE: "u", Query.PING: "u",
    Query.SET: "kv", Query.APPEND: "kv", Query.QUEUE_PUSH: "kv",
    Query.COMPARE_SET: "kvv",
    Query.GET: "k", Query.DELETE_KEY: "k", Query.QUEUE_POP: "k", Query.QUEUE_LEN: "k",
    Query.ADD: "kq", Query.BARRIER: "kq",
    Query.CHECK: "K", Query.WAIT: "K", Query.MULTI_GET: "K",
    Query.MULTI_SET: "S",
    Query.GETNUMKEYS: "", Query.CANCEL_WAIT: "", Query.LIST_KEYS: "",
}
# By the byte on the wire: the query and its fields (a dict: Query(byte) costs more).
_BY_CODE = {int(query): (query, fields) for query, fields in _FIELDS.items()}


class _Short(Exception):
    """Internal: the buffer ends before the request does (at ``size``)."""

    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


# The parser is written for speed, as plain functions over (buffer, position): every
# request of every worker passes through it, in the agent's process, under the GIL.
def _sized(buf, pos: int, end: int, cap: int, what: str) -> tuple[bytes, int]:
    """The key or value at ``pos`` and where it ends; its size checked before anything
    waits for, or keeps, its bytes."""
    if pos + 8 > end:
        raise _Short(pos + 8)
    (size,) = _U64.unpack_from(buf, pos)
    if size > cap:
        raise WireError(f"{what} of {size} bytes (at most {cap})")
    pos += 8
    if pos + size > end:
        raise _Short(pos + size)
    return bytes(buf[pos:pos + size]), pos + size


def _number(buf, pos: int, end: int, fmt: struct.Struct) -> int:
    if pos + fmt.size > end:
        raise _Short(pos + fmt.size)
    return fmt.unpack_from(buf, pos)[0]


def _count(buf, pos: int, end: int) -> int:
    count = _number(buf, pos, end, _U64)  # MULTI_SET sends it as a signed number: the same bytes
    if count > MAX_KEY_COUNT:
        raise WireError(f"{count} keys in one request (at most {MAX_KEY_COUNT})")
    return count


MAX_REQUEST_LEN = 4 * MAX_VALUE_LEN  # one request, announced or whole (torch's largest: a CAS of two values)


def parse_request(buf, start: int = 0, validated: bool = True) -> Union[tuple[Request, int], Need]:
    """The request at ``buf[start:]`` and where it ends, or ``Need`` when it is not all
    there yet; ``WireError`` when it is not one torch's client sends. Before a
    connection is ``validated``, only VALIDATE with the magic number is one."""
    return RequestParser(validated).feed(buf, start)


class RequestParser:
    """One request read as its bytes arrive: what was parsed is kept between pieces, so
    a request that comes in many pieces costs its length once, not once per piece (a
    128 Ki-key MULTI_SET streamed in 64 KiB pieces cost seconds of the server's single
    thread, security review 2, M5). A request longer than ``MAX_REQUEST_LEN`` (more than
    one value and one key of torch's caps can need) is refused as soon as that is known."""

    __slots__ = ("validated", "_start", "_query", "_fields", "_field", "_pos", "_keys", "_values", "_number",
                 "_count")

    def __init__(self, validated: bool = True):
        self.validated = validated
        self._start = -1  # no request under way

    def feed(self, buf, start: int) -> Union[tuple[Request, int], Need]:
        """Go on with the request at ``buf[start:]`` (the same start until it is whole)."""
        if self._start != start:
            self._begin(buf, start)
            if self._start != start:
                return Need(1)
        end = len(buf)
        try:
            while self._field < len(self._fields):
                self._parse_field(buf, end, self._fields[self._field])
        except _Short as short:
            size = short.size - start
            if size > MAX_REQUEST_LEN:
                raise WireError(f"a request of at least {size} bytes (at most {MAX_REQUEST_LEN})") from None
            return Need(size)
        query, number = self._query, self._number
        if query is Query.VALIDATE and number != VALIDATION_MAGIC:
            raise WireError(f"validation with the wrong magic number {number:#x}")
        self.validated = True
        self._start = -1
        return Request(query, tuple(self._keys), tuple(self._values), number), self._pos

    def _begin(self, buf, start: int) -> None:
        if start >= len(buf):
            return
        code = buf[start]
        try:
            self._query, self._fields = _BY_CODE[code]
        except KeyError:
            raise WireError(f"unknown query type {code}") from None
        if self.validated == (self._query is Query.VALIDATE):
            raise WireError("a request before validation" if not self.validated else "a second validation")
        self._start, self._field, self._pos = start, 0, start + 1
        self._keys, self._values, self._number, self._count = [], [], 0, None

    def _parse_field(self, buf, end: int, field: str) -> None:
        """Parse one field (or one key of a counted list) at ``self._pos``; _Short when the
        buffer ends first (nothing is consumed then: the next piece retries it)."""
        pos = self._pos
        if field == "k":
            key, self._pos = _sized(buf, pos, end, MAX_KEY_LEN, "a key")
            self._keys.append(key)
        elif field == "v":
            value, self._pos = _sized(buf, pos, end, MAX_VALUE_LEN, "a value")
            self._values.append(value)
        elif field == "q":
            self._number = _number(buf, pos, end, _I64)
            self._pos = pos + 8
        elif field == "u":
            self._number = _number(buf, pos, end, _U32)
            self._pos = pos + 4
        else:  # "K", "S": a count, then that many keys (or key-value pairs), one per call
            if self._count is None:
                self._count = _count(buf, pos, end)
                self._pos = pos + 8
            elif field == "S" and len(self._values) < len(self._keys):
                value, self._pos = _sized(buf, pos, end, MAX_VALUE_LEN, "a value")
                self._values.append(value)
            elif len(self._keys) < self._count:
                key, self._pos = _sized(buf, pos, end, MAX_KEY_LEN, "a key")
                self._keys.append(key)
            else:
                self._field += 1
            return
        self._field += 1


# -- answers ---------------------------------------------------------------------------
def u8(value: int) -> bytes:
    return _U8.pack(value)


def u32(value: int) -> bytes:
    return _U32.pack(value)


def i64(value: int) -> bytes:
    return _I64.pack(value)


def blob(data: bytes) -> bytes:
    """A value (or a key, in LIST_KEYS' answer): its length, then its bytes."""
    return _U64.pack(len(data)) + data


# -- requests, as torch's client writes them (for tests and probes) ----------------------
def request(query: Query, *fields) -> bytes:
    """The bytes of ``query`` with ``fields`` in ``_FIELDS``' order: bytes for a key or
    a value, an int for a number, a list of keys (or of key-value pairs) for a count."""
    out = [u8(query)]
    for kind, value in zip(_FIELDS[query], fields):
        if kind in "kv":
            out.append(blob(value))
        elif kind == "q":
            out.append(i64(value))
        elif kind == "u":
            out.append(u32(value))
        elif kind == "K":
            out.append(_U64.pack(len(value)) + b"".join(blob(key) for key in value))
        else:
            out.append(_U64.pack(len(value)) + b"".join(blob(k) + blob(v) for k, v in value))
    return b"".join(out)
