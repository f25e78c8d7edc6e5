"""What an agent's store holds and answers: keys, waiting clients, queues.

The state behind store_server.py, kept apart from the sockets so that each query's
meaning is a table of cases (tests/unit/agent/test_store_table.py). ``handle`` takes
one request of one connection and returns the bytes to send, to that connection and
to any others it wakes; it never blocks and never touches a socket. Its meaning is
that of torch 2.13's libuv server (see store_wire.py), except in corners where torch's
answer is a bug no client relies on: a compare-and-set that does not create its key
wakes no waiter, a queue push wakes exactly one waiter (torch could count one down
twice), a wait counts a non-empty queue as present for each of its keys (torch only
when all are), and a new wait replaces the connection's previous one instead of
adding to it.

Unlike torch's, the table is bounded (security review 2, H3): an APPEND may not grow a
value past torch's own cap on a value (8 MiB), the keys and queued items together hold
at most ``MAX_TABLE_BYTES`` in at most ``MAX_TABLE_ENTRIES`` entries, and an answer that
lists or gathers values (LIST_KEYS, MULTI_GET) at most ``MAX_REPLY_LEN`` bytes. What
would pass a bound is refused (a ``WireError``: the writer loses its connection).
"""

from __future__ import annotations

import re
from collections import deque
from typing import Hashable

from .store_wire import (MAX_VALUE_LEN, NOT_READY, READY, STOP_WAITING, WAIT_CANCELED, Query, Request, WireError, blob,
                         i64, u8, u32)

Conn = Hashable  # whatever names a connection (the server uses its socket's number)
Replies = list[tuple[Conn, bytes]]

_KEY_PREFIX = b"/"  # torch's client puts it before every key a user names
_LEADING_INT = re.compile(rb"\s*([+-]?\d+)")  # what std::stoll reads of a value
MAX_REPLY_LEN = 64 * 1024 * 1024  # torch has no cap; ours bounds what one request can make us build
MAX_TABLE_BYTES = 1024 * 1024 * 1024  # keys, values and queued items: what a job's rendezvous needs is kilobytes
MAX_TABLE_ENTRIES = 1024 * 1024  # keys and queued items
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


class StoreTable:
    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        self._waiting: dict[bytes, list[Conn]] = {}  # a key -> the connections waiting for it (a key twice: twice)
        self._awaited: dict[Conn, int] = {}  # a connection -> how many of its keys are still missing
        self._wait_keys: dict[Conn, tuple[bytes, ...]] = {}  # a connection -> the keys it waits for
        self.size = 0  # bytes of keys, values and queued items
        self.entries = 0  # keys and queued items

    # -- the wire ------------------------------------------------------------------
    def handle(self, conn: Conn, req: Request) -> Replies:
        """The answers to ``req`` from ``conn``: (connection, bytes) in sending order.
        WireError when the request cannot be served (a counter that is not a number)."""
        query, keys, values = req.query, req.keys, req.values
        if query is Query.SET:
            return self._set(keys[0], values[0])
        if query is Query.GET:  # one value: at most MAX_VALUE_LEN, as every write checks
            return [(conn, blob(self._data.get(keys[0], b"")))]
        if query is Query.ADD:
            value = self._add(keys[0], req.number)
            return [(conn, i64(value))] + self._wake(keys[0])
        if query is Query.CHECK:
            return [(conn, u8(READY if all(map(self._present, keys)) else NOT_READY))]
        if query is Query.WAIT:
            return self._wait(conn, keys)
        if query is Query.MULTI_GET:
            values = [self._data.get(key, b"") for key in keys]
            if sum(map(len, values)) > MAX_REPLY_LEN:  # one 8 MiB value asked for 128 Ki times: 1 TiB
                raise WireError(f"multi_get of more than {MAX_REPLY_LEN} bytes")
            return [(conn, b"".join(map(blob, values)))]
        if query is Query.MULTI_SET:
            replies: Replies = []
            for key, value in zip(keys, values):
                replies += self._set(key, value)
            return replies
        if query is Query.COMPARE_SET:
            return self._compare_set(conn, keys[0], *values)
        if query is Query.APPEND:
            old = self._data.get(keys[0], b"")
            if len(old) + len(values[0]) > MAX_VALUE_LEN:
                raise WireError(f"append beyond a value of {MAX_VALUE_LEN} bytes")
            return self._set(keys[0], old + values[0])
        if query is Query.DELETE_KEY:
            return [(conn, i64(int(self._pop(keys[0]))))]
        if query is Query.GETNUMKEYS:
            return [(conn, i64(len(self._data)))]
        if query is Query.LIST_KEYS:
            if sum(map(len, self._data)) + 8 * len(self._data) > MAX_REPLY_LEN:
                raise WireError(f"list_keys of more than {MAX_REPLY_LEN} bytes")
            return [(conn, i64(len(self._data)) + b"".join(map(blob, self._data)))]
        if query is Query.CANCEL_WAIT:
            self.forget(conn)
            return [(conn, u8(WAIT_CANCELED))]
        if query is Query.PING:
            return [(conn, u32(req.number))]
        if query is Query.QUEUE_PUSH:
            self._grow(len(keys[0]) + len(values[0]), 1)
            self._queues.setdefault(keys[0], deque()).append(values[0])
            return self._wake(keys[0], only_one=True)
        if query is Query.QUEUE_POP:
            queue = self._queues.get(keys[0])
            if not queue:
                return [(conn, i64(0))]
            size = len(queue)
            item = queue.popleft()
            self.size -= len(keys[0]) + len(item)
            self.entries -= 1
            if not queue:
                del self._queues[keys[0]]
            return [(conn, i64(size) + blob(item))]
        if query is Query.QUEUE_LEN:
            return [(conn, i64(len(self._queues.get(keys[0], ()))))]
        if query is Query.BARRIER:
            return self._barrier(conn, keys[0], req.number)
        return []  # VALIDATE: nothing to answer

    def forget(self, conn: Conn) -> None:
        """``conn`` waits for nothing any more (it cancelled, or it is gone)."""
        self._awaited.pop(conn, None)
        for key in set(self._wait_keys.pop(conn, ())):
            conns = [c for c in self._waiting.get(key, ()) if c != conn]
            if conns:
                self._waiting[key] = conns
            else:
                del self._waiting[key]

    # -- in-process, for the agent (torch's client's view: its key prefix removed) -------
    def list_keys(self) -> list[str]:
        return [key[len(_KEY_PREFIX):].decode("utf-8", "surrogateescape")
                for key in self._data if key.startswith(_KEY_PREFIX)]

    def delete_key(self, key: str) -> bool:
        return self._pop(_KEY_PREFIX + key.encode("utf-8", "surrogateescape"))

    # -- the parts ---------------------------------------------------------------------
    def _present(self, key: bytes) -> bool:
        return key in self._data or bool(self._queues.get(key))

    def _set(self, key: bytes, value: bytes) -> Replies:
        self._store(key, value)
        return self._wake(key)

    def _store(self, key: bytes, value: bytes) -> None:
        """Every write of a key goes through here: the table's bounds are checked first."""
        old = self._data.get(key)
        if old is None:
            self._grow(len(key) + len(value), 1)
        else:
            self._grow(len(value) - len(old), 0)
        self._data[key] = value

    def _grow(self, size: int, entries: int) -> None:
        if self.size + size > MAX_TABLE_BYTES or self.entries + entries > MAX_TABLE_ENTRIES:
            raise WireError(f"the store is full ({self.entries} entries, {self.size} bytes; at most "
                            f"{MAX_TABLE_ENTRIES} and {MAX_TABLE_BYTES})")
        self.size += size
        self.entries += entries

    def _pop(self, key: bytes) -> bool:
        value = self._data.pop(key, None)
        if value is None:
            return False
        self.size -= len(key) + len(value)
        self.entries -= 1
        return True

    def _add(self, key: bytes, delta: int) -> int:
        old = self._data.get(key)
        if old is not None and old.isdigit():  # what counters hold: the quick way
            delta += int(old)
        elif old is not None:
            match = _LEADING_INT.match(old)
            if match is None:
                raise WireError(f"add to a value that is not a number: {old[:40]!r}")
            delta += int(match.group(1))
        if not _I64_MIN <= delta <= _I64_MAX:
            raise WireError("add beyond a 64-bit counter")
        self._store(key, str(delta).encode())
        return delta

    def _compare_set(self, conn: Conn, key: bytes, expected: bytes, desired: bytes) -> Replies:
        current = self._data.get(key)
        if current is None and expected:
            return [(conn, blob(expected))]  # torch's answer; the key stays absent
        if current is None or current == expected:
            self._store(key, desired)
            current = desired
        return [(conn, blob(current))] + self._wake(key)

    def _wait(self, conn: Conn, keys: tuple[bytes, ...]) -> Replies:
        self.forget(conn)
        missing = [key for key in keys if not self._present(key)]
        if not missing:
            return [(conn, u8(STOP_WAITING))]
        self._await(conn, missing)
        return []

    def _barrier(self, conn: Conn, key: bytes, world_size: int) -> Replies:
        count = self._add(key, 1)
        if count >= world_size:
            return self._wake(key) + [(conn, u8(STOP_WAITING))]
        self.forget(conn)
        self._await(conn, [key])
        return []

    def _await(self, conn: Conn, keys: list[bytes]) -> None:
        for key in keys:
            self._waiting.setdefault(key, []).append(conn)
        self._awaited[conn] = len(keys)
        self._wait_keys[conn] = tuple(keys)

    def _wake(self, key: bytes, only_one: bool = False) -> Replies:
        """STOP_WAITING to each connection whose last missing key ``key`` was. A queue's
        new item counts for its first waiter only (one item, one pop)."""
        conns = self._waiting.get(key)
        if not conns:
            return []
        counted, kept = (conns[:1], conns[1:]) if only_one else (conns, [])
        woken: Replies = []
        for conn in counted:
            left = self._awaited.get(conn, 0) - 1
            if left > 0:
                self._awaited[conn] = left
            else:
                self._awaited.pop(conn, None)
                self._wait_keys.pop(conn, None)
                woken.append((conn, u8(STOP_WAITING)))
        if kept:
            self._waiting[key] = kept
        else:
            del self._waiting[key]
        return woken
