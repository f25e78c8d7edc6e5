"""A real three-member etcd cluster on loopback, for tests that kill its leader.

`rendezvous.embedded.EmbeddedEtcd` runs one member, which is all a laptop needs;
a cluster is a test bed only, so it lives here. Each member is a real etcd process
with its own name (``m0``, ``m1``, ...), client port, peer port and data dir, all
listed in every member's ``--initial-cluster``. The members must start together:
none of them answers a request before a quorum has elected a leader.

    cluster = EtcdCluster(3, work_dir).start()
    args = ["--rdzv-endpoint", cluster.endpoints, ...]   # "127.0.0.1:p0,127.0.0.1:p1,..."
    leader = cluster.leader()                             # index, via Maintenance Status
    cluster.kill(leader)                                  # SIGKILL; the others elect a new one
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Optional

import grpc
import pytest
from etcd3 import etcdrpc

from rendezvous.embedded import _die_with_parent, _free_ports, find_etcd_binary
from rendezvous.errors import RendezvousError


class Member:
    def __init__(self, name: str, host: str, client_port: int, peer_port: int, data_dir: Path, log_path: Path):
        self.name, self.host = name, host
        self.client_port, self.peer_port = client_port, peer_port
        self.data_dir, self.log_path = data_dir, log_path
        self.process: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def status(self, timeout: float = 3.0):
        """etcd's Maintenance Status of this member (its own id, the leader's id), or None."""
        with grpc.insecure_channel(self.endpoint) as channel:
            try:
                return etcdrpc.MaintenanceStub(channel).Status(etcdrpc.StatusRequest(), timeout=timeout)
            except grpc.RpcError:
                return None


class EtcdCluster:
    def __init__(self, size: int, work_dir: Path, *, host: str = "127.0.0.1", binary: Optional[str] = None):
        self.binary = binary or find_etcd_binary()
        work_dir.mkdir(parents=True, exist_ok=True)
        ports = _free_ports(host, 2 * size)
        self.members = [
            Member(f"m{i}", host, ports[2 * i], ports[2 * i + 1], work_dir / f"m{i}.data", work_dir / f"m{i}.log")
            for i in range(size)
        ]
        self._initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        # One token for all members (and none shared with another test's cluster).
        self._token = f"cluster-{ports[0]}"

    @property
    def endpoints(self) -> str:
        """Every member's client address, for ``--rdzv-endpoint``."""
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        for member in self.members:
            self._launch(member)
        deadline = time.monotonic() + timeout
        while self.leader() is None:
            for member in self.members:
                if not member.running:
                    raise RendezvousError(f"etcd member {member.name} exited during start-up; see {member.log_path}")
            if time.monotonic() > deadline:
                raise RendezvousError(f"the etcd cluster elected no leader within {timeout:g}s")
            time.sleep(0.1)
        return self

    def leader(self) -> Optional[int]:
        """Index of the member that says it is the leader (its id equals the leader field)."""
        for index, member in enumerate(self.members):
            if member.running:
                status = member.status()
                if status is not None and status.leader != 0 and status.leader == status.header.member_id:
                    return index
        return None

    def kill(self, index: int) -> None:
        process = self.members[index].process
        if process is not None:
            process.kill()
            process.wait(10)

    def stop(self) -> None:
        for member in self.members:
            if member.running:
                member.process.terminate()
        for member in self.members:
            if member.process is not None:
                try:
                    member.process.wait(5)
                except subprocess.TimeoutExpired:
                    member.process.kill()
                    member.process.wait(10)

    def _launch(self, member: Member) -> None:
        client_url = f"http://{member.endpoint}"
        with open(member.log_path, "ab") as log:
            member.process = subprocess.Popen(
                [self.binary, "--name", member.name, "--data-dir", str(member.data_dir),
                 "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                 "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
                 "--initial-cluster", self._initial_cluster, "--initial-cluster-state", "new",
                 "--initial-cluster-token", self._token, "--log-level", "info"],
                # etcd's default raft timers (100 ms heartbeat, 1 s election): shorter ones
                # elect spurious leaders on a loaded 2-core machine. Info level: the
                # logs then say who was elected when ("elected leader"), for diagnosis.
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent, close_fds=True,
            )


@pytest.fixture
def etcd_cluster(tmp_path):
    """A started three-member cluster of this test's own; stopped after the test."""
    try:
        cluster = EtcdCluster(3, tmp_path / "etcd-cluster")
    except RendezvousError as exc:
        pytest.skip(str(exc))
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()
