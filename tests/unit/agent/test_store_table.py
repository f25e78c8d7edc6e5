"""What the agent's store answers (store_table.py), as tables: requests of named
connections in, the bytes each connection is sent out."""

from __future__ import annotations

import struct

import pytest

from elastic.agent import store_table
from elastic.agent.store_table import StoreTable
from elastic.agent.store_wire import Query, Request, WireError

STOP, CANCELED, READY, NOT_READY = b"\x00", b"\x01", b"\x00", b"\x01"


def i64(value: int) -> bytes:
    return struct.pack("=q", value)


def blob(data: bytes) -> bytes:
    return struct.pack("=Q", len(data)) + data


def R(query: Query, *keys: bytes, values=(), number=0) -> Request:
    return Request(query, tuple(keys), tuple(values), number)


# (steps, then the answers of the last step): each step is (connection, request).
CASES = {
    "get of a missing key is empty": ([("a", R(Query.GET, b"k"))], [("a", blob(b""))]),
    "set then get": ([("a", R(Query.SET, b"k", values=[b"v"])), ("b", R(Query.GET, b"k"))], [("b", blob(b"v"))]),
    "add counts from nothing": ([("a", R(Query.ADD, b"n", number=3))], [("a", i64(3))]),
    "add reads the leading number": ([("a", R(Query.SET, b"n", values=[b" -4x"])),
                                      ("a", R(Query.ADD, b"n", number=1))], [("a", i64(-3))]),
    "compare_set of a missing key with an expectation": ([("a", R(Query.COMPARE_SET, b"k", values=[b"x", b"y"])),
                                                          ("a", R(Query.CHECK, b"k"))], [("a", NOT_READY)]),
    "compare_set creates with an empty expectation": ([("a", R(Query.COMPARE_SET, b"k", values=[b"", b"y"]))],
                                                      [("a", blob(b"y"))]),
    "compare_set that does not match answers the current value": (
        [("a", R(Query.SET, b"k", values=[b"cur"])), ("a", R(Query.COMPARE_SET, b"k", values=[b"no", b"new"]))],
        [("a", blob(b"cur"))]),
    "append": ([("a", R(Query.APPEND, b"k", values=[b"1"])), ("a", R(Query.APPEND, b"k", values=[b"2"])),
                ("a", R(Query.GET, b"k"))], [("a", blob(b"12"))]),
    "check of none is ready": ([("a", R(Query.CHECK))], [("a", READY)]),
    "wait for present keys answers at once": ([("a", R(Query.SET, b"k", values=[b""])), ("a", R(Query.WAIT, b"k"))],
                                              [("a", STOP)]),
    "wait for a missing key answers nothing yet": ([("a", R(Query.WAIT, b"k"))], []),
    "a set wakes every waiter of its key": (
        [("a", R(Query.WAIT, b"k")), ("b", R(Query.WAIT, b"k")), ("c", R(Query.SET, b"k", values=[b"v"]))],
        [("a", STOP), ("b", STOP)]),
    "a waiter of two keys wakes on the second": (
        [("a", R(Query.WAIT, b"x", b"y")), ("c", R(Query.SET, b"x", values=[b""])),
         ("c", R(Query.ADD, b"y", number=1))], [("c", i64(1)), ("a", STOP)]),
    "a cancelled wait is not woken": (
        [("a", R(Query.WAIT, b"k")), ("a", R(Query.CANCEL_WAIT)), ("c", R(Query.SET, b"k", values=[b""]))], []),
    "cancel answers even without a wait": ([("a", R(Query.CANCEL_WAIT))], [("a", CANCELED)]),
    "a new wait replaces the old one": (
        [("a", R(Query.WAIT, b"old")), ("a", R(Query.WAIT, b"new")), ("c", R(Query.SET, b"old", values=[b""]))], []),
    "multi_set wakes, multi_get answers in order": (
        [("a", R(Query.WAIT, b"m2")), ("c", R(Query.MULTI_SET, b"m1", b"m2", values=[b"1", b"2"]))], [("a", STOP)]),
    "multi_get of present and missing keys": (
        [("a", R(Query.SET, b"x", values=[b"1"])), ("a", R(Query.MULTI_GET, b"x", b"nope", b"x"))],
        [("a", blob(b"1") + blob(b"") + blob(b"1"))]),
    "delete answers how many": ([("a", R(Query.SET, b"k", values=[b""])), ("a", R(Query.DELETE_KEY, b"k")),
                                 ("a", R(Query.DELETE_KEY, b"k"))], [("a", i64(0))]),
    "num_keys counts keys, not queues": ([("a", R(Query.SET, b"k", values=[b""])),
                                          ("a", R(Query.QUEUE_PUSH, b"q", values=[b"1"])),
                                          ("a", R(Query.GETNUMKEYS))], [("a", i64(1))]),
    "list_keys": ([("a", R(Query.SET, b"/k", values=[b""])), ("a", R(Query.LIST_KEYS))], [("a", i64(1) + blob(b"/k"))]),
    "ping echoes its nonce": ([("a", R(Query.PING, number=77))], [("a", struct.pack("=I", 77))]),
    "a queue's item wakes one waiter only": (
        [("a", R(Query.WAIT, b"q")), ("b", R(Query.WAIT, b"q")), ("c", R(Query.QUEUE_PUSH, b"q", values=[b"1"]))],
        [("a", STOP)]),
    "a waiter on a non-empty queue is answered at once": (
        [("c", R(Query.QUEUE_PUSH, b"q", values=[b"1"])), ("a", R(Query.WAIT, b"q"))], [("a", STOP)]),
    "pop answers the length before, then the item": (
        [("c", R(Query.QUEUE_PUSH, b"q", values=[b"1"])), ("c", R(Query.QUEUE_PUSH, b"q", values=[b"2"])),
         ("a", R(Query.QUEUE_POP, b"q"))], [("a", i64(2) + blob(b"1"))]),
    "pop of an empty queue answers 0 alone": ([("a", R(Query.QUEUE_POP, b"q"))], [("a", i64(0))]),
    "barrier waits for the last one, then wakes all": (
        [("a", R(Query.BARRIER, b"b", number=3)), ("b", R(Query.BARRIER, b"b", number=3)),
         ("c", R(Query.BARRIER, b"b", number=3))], [("a", STOP), ("b", STOP), ("c", STOP)]),
    "barrier of one passes": ([("a", R(Query.BARRIER, b"b", number=1))], [("a", STOP)]),
    "validate answers nothing": ([("a", R(Query.VALIDATE, number=1))], []),
}


@pytest.mark.parametrize("steps, answers", CASES.values(), ids=CASES.keys())
def test_answers(steps, answers):
    table = StoreTable()
    for conn, request in steps[:-1]:
        table.handle(conn, request)
    conn, request = steps[-1]
    assert table.handle(conn, request) == answers


def test_a_forgotten_connection_is_never_woken_and_leaves_nothing_behind():
    table = StoreTable()
    table.handle("gone", R(Query.WAIT, b"x", b"y", b"x"))
    table.handle("kept", R(Query.WAIT, b"x"))
    table.forget("gone")
    assert table.handle("c", R(Query.SET, b"x", values=[b""])) == [("kept", STOP)]
    assert table.handle("c", R(Query.SET, b"y", values=[b""])) == []
    assert not table._waiting and not table._awaited and not table._wait_keys


@pytest.mark.parametrize("steps", [
    [R(Query.SET, b"n", values=[b"text"]), R(Query.ADD, b"n", number=1)],
    [R(Query.SET, b"n", values=[str(2 ** 63 - 1).encode()]), R(Query.ADD, b"n", number=1)],
    [R(Query.SET, b"b", values=[b"x"]), R(Query.BARRIER, b"b", number=2)],
    [R(Query.SET, b"big", values=[b"x" * 1001]), R(Query.MULTI_GET, *[b"big"] * 4)],
], ids=["add-to-text", "add-overflow", "barrier-on-text", "multi-get-too-big"])
def test_requests_that_cannot_be_served_are_refused(steps, monkeypatch):
    monkeypatch.setattr(store_table, "MAX_REPLY_LEN", 4000)  # 64 MiB in the product
    table = StoreTable()
    for request in steps[:-1]:
        table.handle("a", request)
    with pytest.raises(WireError):
        table.handle("a", steps[-1])


def test_the_agents_view_strips_torchs_prefix_and_deletes_through_it():
    table = StoreTable()
    for key in (b"//round/1/pg/rank_0", b"/job", b"init/", "/\u00e9".encode()):
        table.handle("a", R(Query.SET, key, values=[b""]))
    assert sorted(table.list_keys()) == ["/round/1/pg/rank_0", "job", "\u00e9"]
    assert table.delete_key("/round/1/pg/rank_0") and not table.delete_key("/round/1/pg/rank_0")
    assert table.delete_key("\u00e9")
    assert table.list_keys() == ["job"]


# -- the table's bounds (security review 2, H3) ----------------------------------------------
def test_append_cannot_grow_a_value_past_torchs_cap_and_each_write_is_counted():
    from elastic.agent.store_wire import MAX_VALUE_LEN
    table = StoreTable()
    piece = b"x" * (MAX_VALUE_LEN // 4)
    for _ in range(4):
        table.handle("a", R(Query.APPEND, b"grows", values=[piece]))
    with pytest.raises(WireError, match="append beyond"):  # 64 x 8 MiB made one 512 MiB value
        table.handle("a", R(Query.APPEND, b"grows", values=[b"y"]))
    assert table.handle("a", R(Query.GET, b"grows")) == [("a", blob(piece * 4))]  # unchanged
    assert (table.size, table.entries) == (len(b"grows") + MAX_VALUE_LEN, 1)
    table.handle("a", R(Query.DELETE_KEY, b"grows"))
    assert (table.size, table.entries) == (0, 0)


@pytest.mark.parametrize("write", [
    R(Query.SET, b"k3", values=[b"v" * 40]),
    R(Query.MULTI_SET, b"k3", values=[b"v" * 40]),
    R(Query.COMPARE_SET, b"k3", values=[b"", b"v" * 40]),
    R(Query.APPEND, b"k3", values=[b"v" * 40]),
    R(Query.QUEUE_PUSH, b"q", values=[b"v" * 40]),
    R(Query.ADD, b"n", number=1),
], ids=["set", "multi-set", "compare-set", "append", "queue-push", "add"])
def test_a_full_table_refuses_every_kind_of_write(write, monkeypatch):
    monkeypatch.setattr(store_table, "MAX_TABLE_BYTES", 100)
    monkeypatch.setattr(store_table, "MAX_TABLE_ENTRIES", 3)
    table = StoreTable()
    table.handle("a", R(Query.SET, b"k1", values=[b"v" * 40]))
    table.handle("a", R(Query.SET, b"k2", values=[b"v" * 40]))
    table.handle("a", R(Query.SET, b"k0", values=[b""]))  # 3 entries, 86 bytes: full either way
    with pytest.raises(WireError, match="the store is full"):
        table.handle("a", write)
    # Deleting makes room again; popping a queue gives its bytes back.
    table.handle("a", R(Query.DELETE_KEY, b"k1"))
    table.handle("a", R(Query.QUEUE_PUSH, b"q", values=[b"w"]))
    table.handle("a", R(Query.QUEUE_POP, b"q"))
    assert table.entries == 2 and table.size == len(b"k2") + 40 + len(b"k0")


def test_list_keys_answers_are_capped(monkeypatch):
    monkeypatch.setattr(store_table, "MAX_REPLY_LEN", 100)
    table = StoreTable()
    for n in range(10):
        table.handle("a", R(Query.SET, b"key-%d" % n, values=[b""]))
    with pytest.raises(WireError, match="list_keys"):
        table.handle("a", R(Query.LIST_KEYS))
