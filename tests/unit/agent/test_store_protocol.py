"""torch's own TCPStore client against the agent's Python store server (store_server.py):
every operation the client has, answered as torch's own server answers it.

The same script of operations runs against torch 2.13's server and against ours, and
their results must be equal: what torch's server does is the specification, checked
here against the installed binary rather than against a reading of its source. Our
server runs in a process of its own (tests/fakes/store_process.py says why).
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from tests.fakes.store_process import StoreProcess

pytestmark = pytest.mark.timeout(120)


def _client(port: int, timeout: float = 10.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


@pytest.fixture(scope="module")
def ours():
    server = StoreProcess()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def torchs():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def _outcome(call):
    try:
        return call()
    except Exception as exc:  # the kind of failure is part of the answer
        return type(exc).__name__


def _script(store: dist.TCPStore) -> list:
    """Every operation of the client, in the corners where servers could differ."""
    short = datetime.timedelta(seconds=0.2)
    return [_outcome(call) for call in (
        lambda: store.set("k", b"v"), lambda: store.get("k"),
        lambda: store.set("k", ""), lambda: store.get("k"),  # an empty value is a value
        lambda: store.add("n", 5), lambda: store.add("n", -7), lambda: store.get("n"),
        lambda: store.set("s", " 12abc"), lambda: store.add("s", 1),  # a counter reads the leading number
        lambda: store.compare_set("absent", "x", "y"), lambda: store.check(["absent"]),
        lambda: store.compare_set("absent", "", "y"), lambda: store.get("absent"),
        lambda: store.compare_set("absent", "y", "z"), lambda: store.compare_set("absent", "no", "w"),
        lambda: store.get("absent"),
        lambda: store.append("a", b"1"), lambda: store.append("a", b"2"), lambda: store.get("a"),
        lambda: store.check(["k", "n"]), lambda: store.check(["k", "missing"]), lambda: store.check([]),
        lambda: store.wait(["k", "a"]), lambda: store.wait(["k", "missing"], short),
        lambda: store.get("k"),  # the connection still works after a timed-out wait
        lambda: store.wait([]),
        lambda: store.multi_set(["m1", "m2"], [b"one", b"two"]), lambda: store.multi_get(["m2", "m1", "k"]),
        lambda: store.delete_key("m1"), lambda: store.delete_key("m1"), lambda: store.check(["m1"]),
        lambda: store.num_keys(), lambda: sorted(store.list_keys()),
        lambda: store.queue_push("q", b"first"), lambda: store.queue_push("q", b"second"),
        lambda: store.queue_len("q"), lambda: store.check(["q"]), lambda: store.queue_pop("q"),
        lambda: store.queue_pop("q", block=False), lambda: store.queue_pop("q", block=False),
        lambda: store.queue_len("q"), lambda: store.queue_len("never"),
        lambda: store.barrier("b", 1, datetime.timedelta(seconds=5)), lambda: store.get("b"),
        lambda: store.barrier("b2", 2, short), lambda: store.get("k"),
        lambda: dist.PrefixStore("/round/3/", store).set("pg/rank_0", b"addr"),
        lambda: dist.PrefixStore("/round/3/", store).get("pg/rank_0"),
        lambda: store.set("big", b"x" * (1 << 20)), lambda: len(store.get("big")),
        lambda: store.set("k\u00e9", b"\xff\x00"), lambda: store.get("k\u00e9"),
        lambda: sorted(store.list_keys()), lambda: store.num_keys(),
    )]


def test_every_operation_answers_as_torchs_own_server_does(ours, torchs):
    assert _script(_client(ours.port)) == _script(_client(torchs.port))
    # What the agent's pruning sees in process is what torch's client lists.
    assert ours.keys() == sorted(_client(ours.port).list_keys())


def test_a_blocked_wait_is_answered_when_another_client_sets_the_key(ours):
    waiter, setter = _client(ours.port), _client(ours.port)
    got = {}
    thread = threading.Thread(target=lambda: got.update(value=waiter.get("late")))
    thread.start()
    time.sleep(0.2)  # not synchronisation: the answer must come whenever the set does
    assert thread.is_alive(), "a get of a missing key came back before the key was set"
    setter.set("late", b"here")
    thread.join(10)
    assert got == {"value": b"here"}
    # A blocking pop waits for the next push the same way.
    popped = {}
    thread = threading.Thread(target=lambda: popped.update(value=waiter.queue_pop("later-q")))
    thread.start()
    setter.queue_push("later-q", b"item")
    thread.join(10)
    assert popped == {"value": b"item"}


def test_a_wait_times_out_after_its_timeout_and_not_before(ours):
    client = _client(ours.port)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        client.wait(["never-set"], datetime.timedelta(seconds=0.5))
    assert 0.45 < time.monotonic() - started < 5
    client.set("after-timeout", b"1")
    assert client.get("after-timeout") == b"1"


def test_many_clients_at_once_count_every_add(ours):
    clients = [_client(ours.port) for _ in range(24)]
    errors = []

    def count(client):
        try:
            for _ in range(20):
                client.add("many", 1)
            client.wait(["many-go"])  # every one of them blocked at once, then all woken by one set
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=count, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    _client(ours.port).set("many-go", b"1")
    for thread in threads:
        thread.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert _client(ours.port).add("many", 0) == 24 * 20


def test_gloo_builds_a_process_group_over_it(ours):
    """gloo's rendezvous (its addresses under the store's keys, then a full mesh), as a
    round's workers run it: two ranks, in threads of this process."""
    client = _client(ours.port)
    results = {}

    def rank(number):
        store = dist.PrefixStore("/round/1/pg/", client.clone())
        group = dist.ProcessGroupGloo(store, number, 2, datetime.timedelta(seconds=30))
        import torch

        tensor = torch.tensor([float(number + 1)])
        group.allreduce([tensor]).wait()
        results[number] = tensor.item()

    threads = [threading.Thread(target=rank, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {0: 3.0, 1: 3.0}
