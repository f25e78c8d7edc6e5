"""Several "hosts" on one machine: network namespaces on a bridge, with etcd on the bridge.

Each host is a network namespace with its own loopback and one interface ``eth0``
(a veth whose other end sits on a bridge in the root namespace) holding its own
address in a /24 of 10.77.0.0/16 that no other bridge on this machine uses. etcd
listens on the bridge's address in the root namespace, so the test process reaches it
directly and the hosts reach it over their link. Hosts have no default route: test
traffic can only go to the bridge and to the other hosts.

Faults, all undone by ``heal()``:

* ``cut()``: the bridge side of the host's veth goes down, like a pulled cable. The
  host's packets vanish and nobody gets a reset.
* ``cut_peers()``: etcd stays reachable, the other hosts do not (both directions).
* ``cut_etcd()``: the other hosts stay reachable, etcd does not (both directions).

The partial cuts pin the neighbour (ARP) entry of each address on the cut path to a
MAC address nobody has, on both ends. Frames to it are flooded by the bridge and
dropped by everyone, so the cut is silent like a real partition: no local error, no
ICMP, no RST. (A ``blackhole`` route would make the host's own connects fail at once
with EINVAL, which a real partition never does; iptables is not installed here.)

Example (the fixture ``netns_hosts`` in tests/conftest.py builds, sweeps and tears down)::

    def test_partition(netns_hosts, tmp_path):
        hosts = netns_hosts(3)                  # skips, saying why, without root or `ip`
        jobs = [host.job(tmp_path / host.name, [
                    "--rdzv-endpoint", hosts.etcd_endpoint, "--job-id", "j",
                    "--nproc-per-node", "2", "--min-np", "2", "--max-np", "6",
                    "--host-addr", host.addr, str(TRAIN_JOB), ...]) for host in hosts]
        ...
        hosts[1].cut()                          # or cut_peers() / cut_etcd()
        assert not hosts[1].reaches(hosts.bridge_addr, hosts.etcd.client_port)
        hosts[1].heal()

``host.run(argv, **popen_kwargs)`` starts any command inside the host's namespace
(a ``subprocess.Popen``; killed at tear-down if still running). Everything a ``Hosts``
creates is named ``netns-<id>-...`` and recorded with the owner's pid under
``/run/netns-fixture``; ``sweep_leftovers()`` removes whatever a crashed run left.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import signal
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Optional, Sequence

import pytest

from elastic.rendezvous.embedded import EmbeddedEtcd

PREFIX = "netns-"  # every namespace, bridge and veth we create starts with this
IFNAME = "eth0"  # the interface inside each host
REGISTRY = Path("/run/netns-fixture")
_SUBNETS = range(200, 255)  # 10.77.<n>.0/24 candidates; other users of 10.77 take low numbers
_NOBODY_MAC = "02:00:00:00:77:00"  # locally administered, never assigned to an interface
_REACH_PROBE = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
    "except ConnectionRefusedError:\n"
    "    pass  # something answered: the address is reachable\n"
    "except OSError:\n"
    "    sys.exit(1)\n"
)


class NetnsUnavailable(Exception):
    """Namespaces cannot be made here (not root, no `ip`, no kernel support): tests skip."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def check_available() -> None:
    """Raise NetnsUnavailable with the reason if this machine cannot host namespaces."""
    if not sys.platform.startswith("linux"):
        raise NetnsUnavailable("network namespaces need Linux")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
    run_id = f"probe{os.getpid()}"
    try:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / run_id).write_text(f"{os.getpid()}\n")
    except OSError as exc:
        raise NetnsUnavailable(f"cannot write {REGISTRY}: {exc}") from None
    made = _ip("netns", "add", f"{PREFIX}{run_id}", check=False)
    if made.returncode != 0:
        raise NetnsUnavailable(f"cannot create a network namespace: {made.stderr.strip()}")
    _ip("netns", "del", f"{PREFIX}{run_id}", check=False)
    (REGISTRY / run_id).unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_alive(run_id: str) -> bool:
    try:
        return _pid_alive(int((REGISTRY / run_id).read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return False


def existing() -> tuple[list[str], list[str]]:
    """(namespaces, links of the root namespace) named with our prefix."""
    namespaces = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split()[1].split("@")[0].rstrip(":") for line in _ip("-o", "link", "show").stdout.splitlines()]
    return [n for n in namespaces if n.startswith(PREFIX)], [n for n in links if n.startswith(PREFIX)]


def sweep_leftovers() -> list[str]:
    """Remove namespaces and links named ``netns-<id>-...`` whose owning process is gone
    (a crashed or killed earlier run). Returns what was removed."""
    removed = []
    namespaces, links = existing()
    # Links first: deleting a veth removes its pair at once, while a deleted namespace's
    # devices go away later, in the background.
    for name in links + namespaces:
        run_id = name[len(PREFIX):].split("-")[0]
        if _owner_alive(run_id):
            continue
        if name in namespaces:
            _kill_processes_in(name)
            done = _ip("netns", "del", name, check=False)
        else:
            done = _ip("link", "del", name, check=False)
        if done.returncode == 0:
            removed.append(name)
    if REGISTRY.is_dir():
        for entry in REGISTRY.iterdir():
            if entry.name != ".lock" and not _owner_alive(entry.name):
                entry.unlink(missing_ok=True)
    return removed


def _kill_processes_in(namespace: str) -> None:
    """SIGKILL what still runs in a namespace: a namespace outlives `ip netns del` while used."""
    pids = _ip("netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Host:
    """One namespaced host: ``name`` (its namespace), ``addr`` on ``eth0``, ``veth`` (bridge side)."""

    def __init__(self, hosts: "Hosts", index: int, addr: str):
        self._hosts = hosts
        self.index = index
        self.name = f"{hosts.prefix}h{index}"
        self.addr = addr
        self.veth = f"{hosts.prefix}v{index}"
        self.ifname = IFNAME
        self._processes: list[subprocess.Popen] = []
        self._pinned: list[tuple[Optional[str], str, str]] = []  # (namespace, address, device)

    # -- running things

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside this host (killed at tear-down if still running)."""
        process = subprocess.Popen(self.command(argv), **popen_kwargs)
        self._processes.append(process)
        return process

    def job(self, tmp: Path, args: list[str], *, name: str = "job", env: Optional[dict] = None):
        """A ``tests.fakes.jobs.Job`` (one real elastic-run) running inside this host."""
        from tests.fakes.jobs import Job

        tmp.mkdir(parents=True, exist_ok=True)
        job = Job(tmp, args, name=name, env=env, prefix=self.command([]))
        self._processes.append(job.proc)
        return job

    def reaches(self, addr: str, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connect from this host to addr:port gets an answer (accept or refusal)."""
        probe = subprocess.run(self.command([sys.executable, "-c", _REACH_PROBE, addr, str(port), str(timeout)]),
                               capture_output=True, timeout=timeout + 30)
        return probe.returncode == 0

    # -- faults

    def cut(self) -> None:
        """Pull the cable: the bridge side of this host's link goes down."""
        _ip("link", "set", self.veth, "down")

    def cut_peers(self) -> None:
        """The other hosts become unreachable from here and this host from them; etcd stays."""
        for peer in self._hosts:
            if peer is not self:
                self._pin(self.name, peer.addr, IFNAME)
                self._pin(peer.name, self.addr, IFNAME)

    def cut_etcd(self) -> None:
        """The bridge address (etcd, the test process) becomes unreachable both ways; peers stay."""
        self._pin(self.name, self._hosts.bridge_addr, IFNAME)
        self._pin(None, self.addr, self._hosts.bridge)

    def slow_link(self, rate: str = "4mbit", queue_s: float = 0.4) -> None:
        """A slow, bloated link: what leaves this host is shaped to ``rate`` behind a queue
        of up to ``queue_s`` seconds (tc's token bucket filter), so once a bulk flow fills
        it every packet out, a SYN-ACK too, waits about that long."""
        subprocess.run(self.command(["tc", "qdisc", "replace", "dev", IFNAME, "root", "tbf", "rate", rate,
                                     "burst", "32kbit", "latency", f"{int(queue_s * 1000)}ms"]),
                       check=True, capture_output=True)

    def heal(self) -> None:
        """Undo every cut of this host, and a slow link."""
        subprocess.run(self.command(["tc", "qdisc", "del", "dev", IFNAME, "root"]), capture_output=True)
        _ip("link", "set", self.veth, "up")
        for namespace, addr, device in self._pinned:
            netns = ["-n", namespace] if namespace else []
            _ip(*netns, "neigh", "del", addr, "dev", device, check=False)
        self._pinned.clear()

    def _pin(self, namespace: Optional[str], addr: str, device: str) -> None:
        netns = ["-n", namespace] if namespace else []
        _ip(*netns, "neigh", "replace", addr, "lladdr", _NOBODY_MAC, "dev", device, "nud", "permanent")
        self._pinned.append((namespace, addr, device))

    def _kill_processes(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)  # started with start_new_session
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    process.kill()
                except ProcessLookupError:
                    pass
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        _kill_processes_in(self.name)  # workers that left their process group

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.addr})"


class Hosts:
    """N hosts on one bridge, etcd on the bridge address. Index it like a list."""

    def __init__(self, count: int, *, etcd: bool = True, etcd_log: Optional[str] = None):
        self.run_id = uuid.uuid4().hex[:4]
        self.prefix = f"{PREFIX}{self.run_id}-"  # "netns-ab12-" + "v10" stays within 15 characters
        self.bridge = f"{self.prefix}br"
        self.hosts: list[Host] = []
        self.etcd: Optional[EmbeddedEtcd] = None
        self._made_bridge = False
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / self.run_id).write_text(f"{os.getpid()}\n")
        try:
            with open(REGISTRY / ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs must not pick the same subnet
                self.subnet = self._free_subnet()
                self.bridge_addr = str(self.subnet.network_address + 1)
                self._make_bridge()
            for index in range(count):
                self._add_host(index)
            if etcd:
                self.etcd = EmbeddedEtcd(host=self.bridge_addr, log_path=etcd_log).start()
        except BaseException:
            self.destroy()
            raise

    @property
    def etcd_endpoint(self) -> str:
        """host:port of etcd on the bridge, for ``--rdzv-endpoint``."""
        assert self.etcd is not None, "built with etcd=False"
        return self.etcd.endpoint

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self):
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def destroy(self) -> None:
        """Kill what runs inside, stop etcd, remove namespaces, links and the registry entry."""
        for host in self.hosts:
            host._kill_processes()
        if self.etcd is not None:
            self.etcd.stop()
        for host in self.hosts:
            # Delete the veth pair ourselves: the kernel removes a deleted namespace's
            # devices later, in the background, so the names would linger for a while.
            _ip("link", "del", host.veth, check=False)
            _ip("netns", "del", host.name, check=False)
        if self._made_bridge:
            _ip("link", "del", self.bridge, check=False)
        (REGISTRY / self.run_id).unlink(missing_ok=True)

    # -- building

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        used = set()
        for line in _ip("-o", "-4", "route", "show", "table", "all").stdout.splitlines():
            try:
                used.add(ipaddress.ip_network(line.split()[0], strict=False))
            except ValueError:
                continue  # "default", "broadcast", "local ..." lines
        for line in _ip("-o", "-4", "addr", "show").stdout.splitlines():
            used.add(ipaddress.ip_interface(line.split()[3]).network)
        for n in _SUBNETS:
            candidate = ipaddress.ip_network(f"10.77.{n}.0/24")
            if not any(candidate.overlaps(net) for net in used if net.prefixlen > 0):
                return candidate
        raise RuntimeError("no free 10.77.x.0/24 subnet for the namespaced hosts")

    def _make_bridge(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _ip("addr", "add", f"{self.bridge_addr}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def _add_host(self, index: int) -> None:
        host = Host(self, index, str(self.subnet.network_address + 10 + index))
        _ip("netns", "add", host.name)
        self.hosts.append(host)
        _ip("-n", host.name, "link", "set", "lo", "up")
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", IFNAME, "netns", host.name)
        _ip("link", "set", host.veth, "master", self.bridge)
        _ip("link", "set", host.veth, "up")
        _ip("-n", host.name, "addr", "add", f"{host.addr}/{self.subnet.prefixlen}", "dev", IFNAME)
        _ip("-n", host.name, "link", "set", IFNAME, "up")


# ----------------------------------------------------------------------------- pytest fixtures
# Imported into tests/conftest.py, so every test can ask for ``netns_hosts``.


@pytest.fixture(scope="session")
def netns_unavailable() -> Optional[str]:
    """Why namespaces cannot be made here (None if they can); sweeps a crashed run's leftovers once."""
    try:
        check_available()
    except NetnsUnavailable as exc:
        return str(exc)
    sweep_leftovers()
    return None


@pytest.fixture
def netns_hosts(netns_unavailable, tmp_path):
    """A factory ``netns_hosts(count, etcd=True) -> Hosts``; everything it built is removed
    after the test, passed or failed. Skips, saying why, where namespaces cannot be made."""
    if netns_unavailable:
        pytest.skip(netns_unavailable)
    built: list[Hosts] = []

    def make(count: int, *, etcd: bool = True) -> Hosts:
        hosts = Hosts(count, etcd=etcd, etcd_log=str(tmp_path / f"etcd-{len(built)}.log"))
        built.append(hosts)
        return hosts

    yield make
    for hosts in built:
        hosts.destroy()
