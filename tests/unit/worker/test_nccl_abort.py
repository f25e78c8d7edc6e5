"""Leaving and aborting an NCCL ring, on the CPU with a stand-in
backend: the abort never blocks its caller, a blocked abort past its deadline ends the
worker, a failed ring is aborted instead of destroyed, and gloo's path is unchanged."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch.distributed as dist

from elastic.worker import nccl_abort, ring_abort
from elastic.worker.ring_abort import RingHandle


class _BlockingBackend:
    """An abort that blocks until released (a driver call that does not return)."""

    def __init__(self, block: bool = True):
        self.release = threading.Event()
        if not block:
            self.release.set()
        self.entered = threading.Event()

    def abort(self):
        self.entered.set()
        self.release.wait(30)


def _tcp_pair():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return listener, client, server


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_blocked_abort_returns_at_once_and_ends_the_worker_at_its_deadline():
    before = ring_abort.socket_snapshot()
    listener, client, server = _tcp_pair()  # stands for the round store's connection
    overruns = []
    backend = _BlockingBackend()
    handle = RingHandle(ring_abort._connections_since(before), other_backend=backend, deadline_s=0.3,
                        on_overrun=overruns.append)
    try:
        started = time.monotonic()
        handle.abort()  # the etcd watch thread's call: must not wait for NCCL
        assert time.monotonic() - started < 0.25
        assert handle.aborted and handle.backend_abort
        server.settimeout(2)
        assert server.recv(1) == b""  # the store's sockets are shut as on gloo
        assert backend.entered.wait(2)
        assert not handle.wait_aborted()  # still blocked after the deadline
        deadline = time.monotonic() + 2
        while not overruns and time.monotonic() < deadline:
            time.sleep(0.01)
        assert overruns and "did not return within 0.3s" in overruns[0]
    finally:
        backend.release.set()
        for s in (listener, client, server):
            s.close()


def test_an_abort_that_returns_is_waited_for_and_never_overruns():
    overruns = []
    handle = RingHandle(frozenset(), other_backend=_BlockingBackend(block=False), deadline_s=0.5,
                        on_overrun=overruns.append)
    handle.abort()
    assert handle.wait_aborted()
    time.sleep(0.6)  # past the deadline: the watcher must have seen the abort end
    assert overruns == []


def test_leaving_a_failed_nccl_ring_aborts_instead_of_destroying(world_of_one, monkeypatch):
    destroyed = []
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: destroyed.append(a))
    backend = _BlockingBackend(block=False)
    handle = RingHandle(frozenset(), other_backend=backend)
    ring_abort.leave_ring(handle, failed=True, round_number=3)
    assert backend.entered.is_set() and destroyed == []
    assert not dist.is_initialized()  # forgotten through _abort_process_group


def test_a_group_that_cannot_be_torn_down_ends_the_worker(world_of_one, monkeypatch):
    from torch.distributed import distributed_c10d

    def refuse(*_):
        raise RuntimeError("shutdown failed")

    exits = []
    monkeypatch.setattr(dist, "destroy_process_group", refuse)
    monkeypatch.setattr(distributed_c10d, "_abort_process_group", lambda *a: None)
    monkeypatch.setattr(nccl_abort, "exit_broken", exits.append)
    ring_abort.leave_ring(RingHandle(frozenset()), failed=True, round_number=4)
    assert exits and "round 4" in exits[0]


def test_a_gloo_ring_is_still_destroyed_after_a_failure(world_of_one, monkeypatch):
    real = dist.destroy_process_group
    destroyed = []
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: (destroyed.append(1), real()))
    handle = ring_abort.prepare_ring(before=ring_abort.socket_snapshot())
    assert not handle.backend_abort
    ring_abort.leave_ring(handle, failed=True, round_number=1)
    assert destroyed == [1] and not dist.is_initialized()


def test_nonblocking_communicators_are_asked_for_unless_the_user_chose():
    env = {}
    nccl_abort.nonblocking_env(env)
    assert env == {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
    env = {"TORCH_NCCL_USE_COMM_NONBLOCKING": "0"}
    nccl_abort.nonblocking_env(env)
    assert env["TORCH_NCCL_USE_COMM_NONBLOCKING"] == "0"


def test_every_groups_abort_starts_before_any_of_them_ends():
    # An abort that frees its communicator can wait on another one's kernel
    # until that one is aborted too; one after the other, the first never returns.
    groups = 3
    all_started = threading.Barrier(groups, timeout=10)
    ended = []

    def abort(i):
        def run():
            all_started.wait()  # one after the other: BrokenBarrierError after 10 s
            ended.append(i)
        return run

    started = time.monotonic()
    nccl_abort.abort_all_at_once([abort(i) for i in range(groups)])
    assert sorted(ended) == [0, 1, 2] and time.monotonic() - started < 8


def test_one_abort_that_raises_does_not_stop_the_others():
    ended = []

    def fails():
        raise RuntimeError("NCCL error: remote process exited")

    nccl_abort.abort_all_at_once([fails, lambda: ended.append(1), lambda: ended.append(2)])
    assert sorted(ended) == [1, 2]


def test_a_planned_switch_leaves_an_nccl_ring_by_its_abort_and_shuts_no_connection(world_of_one, monkeypatch):
    # destroy_process_group finalizes the communicators and waits for the
    # peers while the runtime's handle is gone already; a peer dying then left a ring that
    # nothing could abort. Leaving by the (deadline-bounded) abort needs no peer.
    destroyed = []
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: destroyed.append(a))
    listener, client, server = _tcp_pair()
    try:
        backend = _BlockingBackend(block=False)
        handle = RingHandle(frozenset({(client.fileno(), _inode(client))}), other_backend=backend)
        ring_abort.leave_ring(handle, failed=False, round_number=5)
        assert backend.entered.is_set() and destroyed == []
        assert not dist.is_initialized()
        client.sendall(b"x")  # its peers leave at the same commit: nothing was shut
        assert server.recv(1) == b"x"
    finally:
        for s in (listener, client, server):
            s.close()


def test_a_planned_leave_whose_abort_blocks_ends_the_worker_at_the_deadline_not_later(world_of_one, monkeypatch):
    overruns = []
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: None)
    backend = _BlockingBackend(block=True)
    handle = RingHandle(frozenset(), other_backend=backend, deadline_s=0.3, on_overrun=overruns.append)
    started = time.monotonic()
    ring_abort.leave_ring(handle, failed=False, round_number=6)
    assert time.monotonic() - started < 5 and overruns, overruns
    backend.release.set()


def _inode(sock) -> int:
    import os

    return os.fstat(sock.fileno()).st_ino
