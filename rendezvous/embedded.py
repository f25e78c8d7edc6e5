"""etcd servers run as child processes: laptops, tests, chaos tests and benchmarks.

`elastic-run` without `--rdzv-endpoint` starts one single-member EmbeddedEtcd, and
the test suite starts them to test against a real etcd. EmbeddedEtcdCluster runs
several members on one host (three by default), for faults that only a real cluster
has: a leader killed, a member lost, quorum lost. The child is tied to its owner: it gets
SIGKILL when the owner dies (Linux PR_SET_PDEATHSIG), and atexit stops it.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Mapping, Sequence

import grpc
from etcd3 import etcdrpc

from .etcd_binary import BINARY_ENV, find_etcd_binary, warn_if_outdated  # noqa: F401 (BINARY_ENV: re-exported)
from .errors import RendezvousAuthError, RendezvousConnectionError, RendezvousError
from .etcd import Etcd, EtcdConfig
from .job_secret import JobSecret, enable_auth
from .private_files import process_dir

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_ERROR_WORDS = ("error", "fatal", "panic", "invalid", "failed", "cannot", "not defined")
# Strong references: a server nobody stopped must still be stopped at exit.
_running: "set[EmbeddedEtcd]" = set()


def _free_ports(host: str, count: int) -> list[int]:
    """Ports the kernel hands out for port 0; etcd may still lose the race for them."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# etcd is started through this launcher, which asks for SIGKILL when the thread that
# started it dies (PR_SET_PDEATHSIG survives the exec) and then becomes etcd. Not a
# preexec_fn: running Python in a child forked from a process with live gRPC threads
# crashes it before the exec (seen: etcd "exited with code -6 during start-up", gRPC's
# epoll poller aborting in the child, when a test restarted etcd under live clients).
_LAUNCHER = f"""
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, signal.SIGKILL, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    os._exit(1)  # the parent is gone already: do not start an orphan etcd
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _tied_to_this_process(command: Sequence[str]) -> list[str]:
    """``command`` run so that it dies with the thread that starts it."""
    return [sys.executable, "-I", "-c", _LAUNCHER, str(os.getpid()), *command]


class EmbeddedEtcd:
    """One etcd member on loopback ports.

    Start it from a long-lived thread (the main thread): PR_SET_PDEATHSIG fires
    when the *thread* that forked the child exits.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        *,
        host: str = "127.0.0.1",
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        scheme: str = "http",
        log_path: str | None = None,
        client_options: Mapping[str, object] | None = None,
        port: int = 0,
        security: JobSecret | None = None,
        server_names: Sequence[str] = (),
    ):
        """``port``: a fixed client port (others must find it: Slurm's first node); 0 picks a free one.

        ``security``: TLS with a server certificate of the job's CA (for ``host`` and
        ``server_names``) and etcd auth on before start() returns, clients logging in as
        the job's user (job_secret.py); ``client_files`` then says what other hosts need."""
        if security is not None:
            scheme = "https"
        if scheme not in ("http", "https"):
            raise RendezvousError(f"invalid embedded etcd scheme {scheme!r}: expected http or https")
        self.host = host
        self.binary = binary
        self.extra_args = tuple(extra_args)
        self.scheme = scheme
        # EtcdConfig fields (ca_cert, user, ...) used by config() and the health check.
        self.client_options = dict(client_options or {})
        self._data_dir = data_dir
        self._fixed_port = port
        self.security = security
        self._server_names = tuple(server_names)
        self.client_files = None  # job_secret.ClientFiles, with security
        self._tls_args: tuple[str, ...] = ()
        self._auth_on = False  # set once enable_auth has run on this data dir
        self._log_path = log_path
        self._work_dir: str | None = None  # temp dir we created (removed on stop)
        self.client_port = 0
        self.peer_port = 0
        self._process: subprocess.Popen | None = None
        self._log_file = None
        self._log_offset = 0  # where this launch's output starts in the log
        self._lock = threading.Lock()
        # Set by EmbeddedEtcdCluster for its members; a lone server is its own cluster.
        self._name = "embedded"
        self._initial_cluster: str | None = None
        self._cluster_token = "embedded"
        # One member on loopback: short raft timers make start-up and restart fast.
        # Several members keep etcd's defaults (100 ms heartbeat, 1 s election): shorter
        # ones elect spurious leaders between members on a loaded 2-core machine.
        self._raft_timers: tuple[str, ...] = ("--heartbeat-interval", "25", "--election-timeout", "250")

    # -- properties

    @property
    def name(self) -> str:
        """The member's name in its cluster ("embedded" when alone)."""
        return self._name

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def data_dir(self) -> str | None:
        return self._data_dir

    @property
    def log_path(self) -> str | None:
        return self._log_path

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def config(self, **kwargs) -> EtcdConfig:
        """An EtcdConfig for this server; kwargs override `client_options`."""
        options = {**self.client_options, **kwargs}
        return EtcdConfig(endpoints=((self.host, self.client_port),), **options)

    # -- lifecycle

    def start(self, timeout: float = 20.0) -> "EmbeddedEtcd":
        """Start on free ports and wait until a real request succeeds."""
        if self.running:
            raise RendezvousError(f"embedded etcd already running at {self.endpoint}")
        self.binary = self.binary or find_etcd_binary()
        warn_if_outdated(self.binary, self.host)
        if self._work_dir is None and (self._data_dir is None or self._log_path is None or self.security):
            # 0700, in the process's private directory, which goes even when the process is
            # SIGKILLed: the keys, the CA and the password with security, and the data and log
            # in any case (a killed test's or launcher's were left in /tmp for ever).
            self._work_dir = tempfile.mkdtemp(prefix="elastic-etcd-", dir=process_dir())
        if self._data_dir is None:
            self._data_dir = os.path.join(self._work_dir, "data")
        if self._log_path is None:
            self._log_path = os.path.join(self._work_dir, "etcd.log")
        if self.security is not None:
            self._secure(self._work_dir)
        # Two tries: another process may grab a port between our probe and etcd's bind.
        for last_try in (False, True):
            self.client_port = _free_ports(self.host, 1)[0]
            self.peer_port = _free_ports("127.0.0.1" if self._initial_cluster is None else self.host, 1)[0]
            self.client_port = self._fixed_port or self.client_port
            try:
                self._launch(timeout)
                return self
            except _BindRace:
                if last_try:
                    raise RendezvousError(f"embedded etcd could not bind free ports: {self._log_tail()}") from None
                log.info("embedded etcd lost a port race; retrying with new ports")
        return self

    def _secure(self, directory: str) -> None:
        files = self.client_files = self.security.client_files(directory)
        server = self.security.server_files(directory, (self.host, *self._server_names))
        # bcrypt's default cost (10) makes every log-in cost etcd ~0.1 s of CPU, and under
        # load clients that time out and log in again pile up; the passwords are 256-bit
        # derivations of the secret, which no slower hash could make harder to guess.
        self._tls_args = ("--cert-file", server.cert, "--key-file", server.key, "--bcrypt-cost", "4",
                          # Peers too (as a served member's, served.py): raft in plaintext took one
                          # forged heartbeat to panic etcd (security review 2, H1).
                          "--peer-cert-file", server.cert, "--peer-key-file", server.key,
                          "--peer-client-cert-auth", "--peer-trusted-ca-file", files.ca_cert)
        self.client_options.update(ca_cert=files.ca_cert, user=files.user, password=self.security.password)

    def restart(self, timeout: float = 20.0) -> None:
        """Start again on the same data dir and ports (after kill() or stop())."""
        if self.running:
            raise RendezvousError(f"embedded etcd already running at {self.endpoint}")
        if not self.client_port or self._data_dir is None:
            raise RendezvousError("embedded etcd has no data dir to restart from: call start() instead")
        try:
            self._launch(timeout)
        except _BindRace:
            raise RendezvousError(f"embedded etcd could not bind {self.endpoint} again: {self._log_tail()}") from None

    def kill(self) -> None:
        """SIGKILL now, keeping the data dir (chaos tests)."""
        with self._lock:
            process = self._process
            if process is None:
                return
            process.kill()
            process.wait(timeout=10)
            self._close_log()

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL if needed; remove the temp dir if we created it."""
        with self._lock:
            process, self._process = self._process, None
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
            self._close_log()
            _running.discard(self)
            if self._work_dir is not None:
                shutil.rmtree(self._work_dir, ignore_errors=True)
                self._work_dir = None
                # The paths inside it are gone too; a later start() makes new ones.
                if self._data_dir and not os.path.exists(self._data_dir):
                    self._data_dir = None
                if self._log_path and not os.path.exists(self._log_path):
                    self._log_path = None

    def __enter__(self) -> "EmbeddedEtcd":
        return self if self.running else self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedEtcd({self.url}, data_dir={self._data_dir})"

    # -- internals

    def _command(self) -> list[str]:
        client_url = f"{self.scheme}://{self.host}:{self.client_port}"
        # A lone member never talks to peers: its peer port stays on loopback whatever its
        # client address (on the node's routable address strangers reached raft: review 2, H1).
        peer_host = "127.0.0.1" if self._initial_cluster is None else self.host
        peer_url = f"{'https' if self.security is not None else 'http'}://{peer_host}:{self.peer_port}"
        return [
            self.binary,
            "--name", self._name,
            "--data-dir", self._data_dir,
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", self._initial_cluster or f"{self._name}={peer_url}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", self._cluster_token,
            "--log-level", "warn",
            *self._raft_timers,
            # Fewer entries between snapshots keep the WAL small.
            "--snapshot-count", "10000",
            *self._tls_args,
            *self.extra_args,
        ]

    def _launch(self, timeout: float) -> None:
        if self.security is not None and not self._auth_on and self.host != "127.0.0.1":
            # Auth is enabled on loopback first: on the public address, a client (a stranger
            # adding its own root user, or a node of the job) must never find it still off.
            public, self.host = self.host, "127.0.0.1"
            try:
                self._launch_once(timeout)
            finally:
                self.host = public
            with self._lock:
                self._process.terminate()
                self._process.wait(timeout=10)
                self._close_log()
        self._launch_once(timeout)

    def _launch_once(self, timeout: float) -> None:
        self._spawn()
        try:
            self._wait_healthy(timeout)
            if self.security is not None and not self._auth_on:  # before anyone else can use it
                enable_auth(self.endpoint, self.security, self.security.ca_pem())
                self._auth_on = True
        except BaseException:
            self.kill()
            raise

    def _spawn(self) -> None:
        with self._lock:
            self._log_file = open(self._log_path, "ab")
            self._log_offset = self._log_file.tell()
            self._process = subprocess.Popen(
                _tied_to_this_process(self._command()),
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                close_fds=True,
            )
            _running.add(self)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # First until the client port takes connections, with plain sockets: a gRPC
        # channel refused while etcd starts goes into its reconnect back-off, which
        # cost every start about 0.3 s after etcd was in fact ready.
        while not self._accepts_connections():
            if self._process.poll() is not None or time.monotonic() >= deadline:
                break  # said below, with the log's reason
            time.sleep(0.01)
        config = self.config(call_timeout=1.0, retry_deadline=1.0,  # no log-in before enable_auth: "auth disabled"
                             **({"user": None, "password": None} if self.security and not self._auth_on else {}))
        with Etcd(config) as client:
            while True:
                if self._process.poll() is not None:
                    tail = self._log_tail()
                    if "address already in use" in tail:
                        raise _BindRace()
                    raise RendezvousError(
                        f"embedded etcd exited with code {self._process.returncode} during start-up: {tail}")
                try:
                    client.check(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
                    return
                except RendezvousAuthError:
                    return  # it answered: auth is a matter for the caller's config
                except RendezvousConnectionError:
                    pass
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"embedded etcd at {self.endpoint} not healthy within {timeout:g}s: {self._log_tail()}")
                time.sleep(0.05)

    def _accepts_connections(self) -> bool:
        try:
            with socket.create_connection((self.host, self.client_port), timeout=0.2):
                return True
        except OSError:
            return False

    def _log_tail(self, lines: int = 3) -> str:
        """The lines of this launch's log that say what went wrong, joined into one line."""
        try:
            with open(self._log_path, "rb") as f:
                f.seek(max(self._log_offset, os.path.getsize(self._log_path) - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"
        all_lines = [line.strip() for line in text.splitlines() if line.strip()]
        # etcd prints its usage after a bad flag, and zap logs are long JSON: prefer
        # the lines that name an error over whatever came last.
        errors = [line for line in all_lines if any(w in line.lower() for w in _ERROR_WORDS)]
        return " | ".join((errors or all_lines)[-lines:]) or f"(empty log {self._log_path})"

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class _BindRace(Exception):
    """Internal: etcd could not bind a port we probed as free."""


class EmbeddedEtcdCluster:
    """`size` etcd members (three by default) of one cluster, all on `host`.

    For faults a single member cannot show: the leader SIGKILLed (``members[i].kill()``,
    ``leader()`` says which one leads), a minority lost, quorum lost. Each member is an
    EmbeddedEtcd with its own ports, data dir and log; ``members[i].restart()`` brings
    a killed one back into the cluster. Start it from a long-lived thread, as a member.
    """

    def __init__(self, size: int = 3, *, host: str = "127.0.0.1", binary: str | None = None,
                 extra_args: Sequence[str] = (), log_dir: str | None = None):
        if size < 1:
            raise RendezvousError(f"invalid etcd cluster size {size}: expected at least 1")
        self.members = [EmbeddedEtcd(host=host, binary=binary, extra_args=extra_args) for _ in range(size)]
        self.log_dir = log_dir  # member logs go there (kept after stop) instead of the temp dirs
        token = f"cluster-{uuid.uuid4().hex[:8]}"  # peers of another test's cluster are not ours
        for index, member in enumerate(self.members):
            member._name = f"member{index}"
            member._cluster_token = token
            member._raft_timers = ()

    @property
    def endpoints(self) -> str:
        """host:port,host:port,... as `--rdzv-endpoint` takes them."""
        return ",".join(member.endpoint for member in self.members)

    def config(self, **kwargs) -> EtcdConfig:
        return EtcdConfig(endpoints=tuple((m.host, m.client_port) for m in self.members), **kwargs)

    def start(self, timeout: float = 30.0) -> "EmbeddedEtcdCluster":
        """Start every member at once (a member alone never becomes healthy: no quorum)."""
        for last_try in (False, True):
            ports = iter(_free_ports(self.members[0].host, 2 * len(self.members)))
            for member in self.members:
                member.client_port, member.peer_port = next(ports), next(ports)
            initial = ",".join(f"{m._name}=http://{m.host}:{m.peer_port}" for m in self.members)
            for member in self.members:
                member._initial_cluster = initial
                member.binary = member.binary or find_etcd_binary()
                member._work_dir = tempfile.mkdtemp(prefix="elastic-etcd-", dir=process_dir())
                member._data_dir = os.path.join(member._work_dir, "data")
                member._log_path = os.path.join(self.log_dir or member._work_dir, f"{member._name}.log")
                member._spawn()
            try:
                for member in self.members:
                    member._wait_healthy(timeout)
                return self
            except _BindRace:
                self.stop()
                if last_try:
                    raise RendezvousError("embedded etcd cluster could not bind free ports") from None
            except BaseException:
                self.stop()
                raise
        return self

    def leader(self, timeout: float = 2.0) -> EmbeddedEtcd | None:
        """The member that leads now, as a running member says (None if none knows)."""
        for member in self.members:
            if not member.running:
                continue
            with grpc.insecure_channel(member.endpoint) as channel:
                try:
                    status = etcdrpc.MaintenanceStub(channel).Status(etcdrpc.StatusRequest(), timeout=timeout)
                except grpc.RpcError:
                    continue
            for candidate in self.members:
                if candidate.running and _member_id(candidate, timeout) == status.leader:
                    return candidate
        return None

    def wait_leader(self, timeout: float, *, not_: EmbeddedEtcd | None = None) -> EmbeddedEtcd | None:
        """The leader once there is one (other than ``not_``), or None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.leader(timeout=1.0)
            if leader is not None and leader is not not_:
                return leader
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def __enter__(self) -> "EmbeddedEtcdCluster":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _member_id(member: EmbeddedEtcd, timeout: float) -> int | None:
    """The raft id a member reports for itself (its responses' header)."""
    with grpc.insecure_channel(member.endpoint) as channel:
        try:
            return etcdrpc.MaintenanceStub(channel).Status(etcdrpc.StatusRequest(), timeout=timeout).header.member_id
        except grpc.RpcError:
            return None


@atexit.register
def _stop_all() -> None:
    for server in list(_running):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
