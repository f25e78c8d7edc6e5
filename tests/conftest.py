"""Shared fixtures: real etcd servers (embedded), clients, per-test key prefixes, leak checks."""

from __future__ import annotations

import compileall
import os
import signal
import threading
import time
import uuid

import pytest

from elastic.rendezvous import embedded
from elastic.rendezvous.embedded import EmbeddedEtcd, find_etcd_binary
from elastic.rendezvous.errors import RendezvousError
from elastic.rendezvous.etcd import Etcd
from tests.fakes.netns import netns_hosts, netns_unavailable  # noqa: F401 - fixtures: hosts as namespaces

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the agents and workers that the tests start import from this checkout.
_COMPILED = ("elastic", "rendezvous", "checkpoint", "tests/fakes", "examples", "benchmarks")

# Servers that outlive one test (session scope): their processes are not leaks.
_long_lived_servers: list[EmbeddedEtcd] = []
# Threads our rendezvous code starts; a test that leaves one running leaks it.
_OWN_THREAD_PREFIXES = ("etcd-watch:", "etcd-session:")


def pytest_configure(config):
    """Compile the package's bytecode once, before any test starts a process.

    With PYTHONDONTWRITEBYTECODE set (CI's environment and this machine's have it) no
    process writes a .pyc, so every agent and worker the suite starts compiled the ~80
    modules of ours it imports from source again: 0.3 s of CPU each (0.8 s -> 0.5 s for
    the package's imports, torch's aside, measured on the 2-core machine). A .pyc
    written here is read by all of them (it is checked against its source's mtime, so an
    edited module is compiled again as usual)."""
    for folder in _COMPILED:
        compileall.compile_dir(os.path.join(REPO, folder), quiet=2)


def etcd_binary_or_skip() -> str:
    """The etcd server binary, or skip the test (the only reason to skip an etcd test)."""
    try:
        return find_etcd_binary()
    except RendezvousError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def etcd_server():
    """One embedded etcd for the whole run. Tests must not kill it: use `fresh_etcd`."""
    server = EmbeddedEtcd(binary=etcd_binary_or_skip()).start()
    _long_lived_servers.append(server)
    yield server
    server.stop()
    _long_lived_servers.remove(server)


@pytest.fixture
def etcd(etcd_server):
    """A client of the shared server, closed after the test."""
    client = Etcd(etcd_server.config())
    yield client
    client.close()


@pytest.fixture
def job_prefix() -> str:
    """A key prefix no other test uses, so tests share one etcd without seeing each other."""
    return f"/elastic/test-{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def fresh_etcd(tmp_path):
    """An etcd of this test's own, for tests that kill or restart it."""
    server = EmbeddedEtcd(binary=etcd_binary_or_skip(), log_path=str(tmp_path / "etcd.log")).start()
    yield server
    server.stop()


# ----------------------------------------------------------------------------- leak checks


def _child_pids(me: int):
    """Our children's pids as the kernel lists them per thread, or None where it does not
    (a kernel without CONFIG_PROC_CHILDREN): reading /proc whole instead costs 7 ms on a
    shared machine, twice per test."""
    pids = []
    try:
        for tid in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{tid}/children") as f:
                pids += f.read().split()
    except OSError:  # no such file, or a thread that ended meanwhile: read /proc whole
        return None
    return pids


def _live_children() -> dict[int, str]:
    """pid -> command name of our direct children that are still running (zombies excluded)."""
    me = os.getpid()
    children = {}
    candidates = _child_pids(me)
    for entry in os.listdir("/proc") if candidates is None else candidates:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'.
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if int(ppid) == me and state != "Z":
            children[int(entry)] = comm
    return children


@pytest.fixture(autouse=True)
def no_leaked_child_processes():
    """Fail a test that leaves child processes running (and kill them, so the next test is clean)."""
    if not os.path.isdir("/proc"):
        yield
        return
    before = set(_live_children())
    # Servers of wider-scoped fixtures may be restarted by the test (new pid, same object).
    servers_before = list(embedded._running)
    yield
    deadline = time.monotonic() + 3.0  # children being stopped get a moment to exit
    while True:
        allowed = before | {s.pid for s in [*_long_lived_servers, *servers_before] if s.pid is not None}
        leaked = {pid: name for pid, name in _live_children().items() if pid not in allowed}
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if leaked:
        pytest.fail(f"test left child processes running: {leaked}")


@pytest.fixture
def no_leaked_threads():
    """Opt-in: fail if the test leaves watch or session threads running."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 3.0
    while True:
        leaked = [t.name for t in threading.enumerate()
                  if t not in before and t.is_alive() and t.name.startswith(_OWN_THREAD_PREFIXES)]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if leaked:
        pytest.fail(f"test left rendezvous threads running: {leaked}")
