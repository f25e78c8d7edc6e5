"""The chaos soak's test bed: a 3-member etcd cluster on the hosts' bridge and one
replaceable elastic-run agent per namespaced host, all writing to one shared steps file.

Kept apart from ``test_soak.py`` so that the test reads as the fault schedule and
its checks. The cluster is built here rather than with ``rendezvous.embedded``
(single member) so that the soak can SIGKILL a real raft leader and restart it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import grpc
from etcd3 import etcdrpc

from rendezvous.embedded import find_etcd_binary
from tests.fakes.jobs import REPO, TRAIN_JOB, read_jsonl

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: the member dies with the test, even if the test is SIGKILLed."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    process: Optional[subprocess.Popen] = None
    member_id: int = 0  # raft id, known once it answered a status request


class EtcdCluster:
    """Three etcd processes on ``host`` (the bridge address), one raft cluster."""

    def __init__(self, host: str, work: Path, size: int = 3):
        self.host = host
        self.token = f"soak-{uuid.uuid4().hex[:8]}"
        self.members = [
            _Member(f"m{i}", _free_port(host), _free_port(host), work / f"etcd-m{i}", work / f"etcd-m{i}.log")
            for i in range(size)
        ]
        self._binary = find_etcd_binary()

    @property
    def endpoints(self) -> str:
        """``--rdzv-endpoint`` value: every member, so clients fail over."""
        return ",".join(f"{self.host}:{m.client_port}" for m in self.members)

    def start(self, timeout: float = 60) -> "EtcdCluster":
        for member in self.members:
            self._launch(member)
        if self.wait_leader(timeout) is None:
            raise RuntimeError(f"etcd cluster elected no leader within {timeout}s")
        return self

    def _launch(self, member: _Member) -> None:
        peers = ",".join(f"{m.name}=http://{self.host}:{m.peer_port}" for m in self.members)
        client, peer = f"http://{self.host}:{member.client_port}", f"http://{self.host}:{member.peer_port}"
        argv = [self._binary, "--name", member.name, "--data-dir", str(member.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", peers, "--initial-cluster-state", "new",
                "--initial-cluster-token", self.token, "--log-level", "warn"]
        # etcd's default raft timers (100 ms heartbeat, 1 s election): a loaded
        # 2-core machine must not make the members elect leaders all the time.
        with open(member.log, "ab") as log:
            member.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                              preexec_fn=_die_with_parent, close_fds=True)

    def _status(self, member: _Member):
        if member.process is None or member.process.poll() is not None:
            return None
        with grpc.insecure_channel(f"{self.host}:{member.client_port}") as channel:
            try:
                status = etcdrpc.MaintenanceStub(channel).Status(etcdrpc.StatusRequest(), timeout=1.0)
            except grpc.RpcError:
                return None
        member.member_id = status.header.member_id
        return status

    def leader(self) -> Optional[_Member]:
        """The member that says it leads, or None during an election."""
        for member in self.members:
            status = self._status(member)
            if status is not None and status.leader and status.leader == member.member_id:
                return member
        return None

    def wait_leader(self, timeout: float, *, not_: Optional[_Member] = None) -> Optional[_Member]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None and leader is not not_:
                return leader
            time.sleep(0.05)
        return None

    def kill(self, member: _Member) -> None:
        member.process.kill()
        member.process.wait(10)

    def restart(self, member: _Member, timeout: float = 60) -> None:
        """Start a killed member again on its data dir; return once it follows a leader."""
        self._launch(member)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self._status(member)
            if status is not None and status.leader:
                return
            time.sleep(0.05)
        raise RuntimeError(f"etcd member {member.name} did not rejoin within {timeout}s")

    def stop(self) -> None:
        for member in self.members:
            if member.process is not None and member.process.poll() is None:
                member.process.kill()
                member.process.wait(10)


@dataclass
class Agent:
    """One elastic-run on a host; ``generation`` counts the agents that host has had."""

    host: object  # tests.fakes.netns.Host
    job: object  # tests.fakes.jobs.Job
    generation: int
    started: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.job.proc.pid

    def worker_pids(self) -> list[int]:
        """Live children of the agent (its workers). ``ip netns exec`` execs, so the
        agent's pid is the Popen's."""
        found = []
        for task in Path(f"/proc/{self.pid}/task").glob("*"):
            try:
                found += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                pass
        return found


class Fleet:
    """One agent per host, replaceable; every worker appends to ``out/steps.jsonl``."""

    def __init__(self, hosts, cluster: EtcdCluster, tmp: Path, launcher: list[str], script: list[str]):
        self.hosts, self.cluster, self.tmp = hosts, cluster, tmp
        self.out = tmp / "out"
        self.stop_file = tmp / "stop"
        self._launcher, self._script = launcher, script
        self.agents: dict[int, Agent] = {}
        self.retired: list[Agent] = []

    def start_agent(self, index: int) -> Agent:
        host = self.hosts[index]
        generation = sum(1 for a in self.retired if a.host is host) + (index in self.agents)
        work = self.tmp / f"{host.name}-a{generation}"
        args = ["--rdzv-endpoint", self.cluster.endpoints, "--host-id", host.name, "--host-addr", host.addr,
                *self._launcher, "--log-dir", str(work / "logs"), str(TRAIN_JOB),
                "--out", str(self.out), "--stop-file", str(self.stop_file), *self._script]
        agent = Agent(host, host.job(work, args, name="agent"), generation)
        if index in self.agents:
            self.retired.append(self.agents[index])
        self.agents[index] = agent
        return agent

    def steps(self) -> list[dict]:
        return read_jsonl(self.out / "steps.jsonl")

    def rounds(self) -> list[dict]:
        return read_jsonl(self.out / "pids.jsonl")

    def events(self, after: float = 0.0) -> list[dict]:
        found = []
        for path in self.tmp.glob("*/logs/events.jsonl"):
            found += [e for e in read_jsonl(path) if e["time"] > after]
        return sorted(found, key=lambda e: e["time"])

    def ring_pid(self, index: int) -> Optional[int]:
        """The worker of host ``index`` that trains in the newest round."""
        entries = self.rounds()
        newest = max(e["round"] for e in entries)
        in_ring = {e["pid"] for e in entries if e["round"] == newest}
        mine = [p for p in self.agents[index].worker_pids() if p in in_ring]
        return mine[0] if mine else None


def single_process_reference(out: Path, script: list[str], steps: int) -> dict:
    """Final parameters of the same script run alone (world 1) for ``steps`` steps."""
    import torch

    args = list(script)
    args[args.index("--steps") + 1] = str(steps)
    if "--step-delay" in args:  # pacing for the faults only: the trajectory does not depend on it
        del args[args.index("--step-delay"):args.index("--step-delay") + 2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["PYTHONPATH"] = str(REPO)
    subprocess.run([sys.executable, str(TRAIN_JOB), *args, "--out", str(out)],
                   env=env, check=True, timeout=300, capture_output=True)
    (final,) = out.glob("final-*.pt")
    return torch.load(final, weights_only=True)
