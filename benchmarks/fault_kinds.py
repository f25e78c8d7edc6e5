"""The fault kinds of benchmarks.faults: the job each runs on, how the fault is made,
and what is read back from the workers' step timings.

Topologies (one fresh job, and a fresh etcd, per rep):
  local   2 agents x 2 workers on loopback (crash, hang, the etcd faults)
  netns   3 hosts x 2 workers, each host a network namespace on a bridge
          (tests/fakes/netns.py), etcd on the bridge, `--host-addr` given

Launchers: elastic-run (every option at its default but the world bounds), and
torchrun with the c10d rendezvous (one agent per host, `--nnodes 1:<hosts>`,
`--max-restarts 3`, a checkpoint file every 20 steps), with or without
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. In namespaces torchrun gets `--local-addr` and
GLOO_SOCKET_IFNAME=eth0, which it needs there and a user would set by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import socket
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

from elastic.rendezvous import EmbeddedEtcd, EmbeddedEtcdCluster, Etcd, JobKeys

from . import harness

WORKERS_PER_HOST = 2
TORCHRUN_PORT = 29400  # c10d store of torchrun's agent on host 0 (a namespace has its own ports)


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    netns: bool  # needs namespaced hosts
    etcd: str  # "single" or "cluster" (a 3-member cluster on loopback)
    measure: str  # "recovery": fault -> next step of the re-formed ring; "pause": longest gap between steps
    torchrun: bool  # torchrun can run under this fault at all (it has no etcd)
    what: str


KINDS = {k.name: k for k in (
    Kind("crash", False, "single", "recovery", True, "SIGKILL of a random non-zero rank"),
    Kind("hang", False, "single", "recovery", True, "SIGSTOP of a random non-zero rank (never resumed)"),
    Kind("partition-host", True, "single", "recovery", True,
         "link of a host holding neither rank 0 nor the coordinator cut"),
    Kind("partition-rank0", True, "single", "recovery", True, "link of the host of rank 0 and the coordinator cut"),
    # A lost VM or an OOM-killed pod: everything on the host dies, its kernel still
    # answers (connections reset, its agent's port refuses).
    Kind("host-kill-rank0", True, "single", "recovery", True,
         "agent and workers of the host of rank 0, its store and the coordinator SIGKILLed"),
    Kind("etcd-leader-kill", False, "cluster", "pause", False, "SIGKILL of the leader of a 3-member etcd"),
    Kind("etcd-outage", False, "single", "pause", False, "etcd SIGKILLed, restarted after --outage s"),
    Kind("etcd-freeze", False, "single", "pause", False, "etcd SIGSTOPped, SIGCONT after --outage s"),
)}
LAUNCHERS = ("elastic", "torchrun", "torchrun-noshare")


@dataclasses.dataclass
class Fault:
    time: float  # wall clock of the fault (the step files hold wall-clock times)
    end: float  # when a fault with a duration was undone (= time otherwise)
    victims: set[int]  # worker pids the fault took away (excluded from "next step")
    info: dict
    undo: Callable[[], None] = lambda: None


class Cluster:
    """One rep's job: etcd, hosts, one agent per host; close() removes all of it."""

    def __init__(self, kind: Kind, launcher: str, workdir: Path, hosts_factory=None) -> None:
        self.kind, self.launcher, self.workdir = kind, launcher, workdir
        self.timing_dir, self.log_dir = workdir / "timing", workdir / "logs"
        self.timing_dir.mkdir(parents=True)
        self.job_id = f"faults-{workdir.name[-8:]}".replace("_", "-")
        self.jobs: list[harness.Job] = []
        self.hosts = hosts_factory(3) if kind.netns else None
        self.host_count = len(self.hosts) if self.hosts is not None else 2
        self.etcd: Optional[EmbeddedEtcd] = None
        self.etcd_cluster: Optional[EmbeddedEtcdCluster] = None
        if self.hosts is not None:
            self.etcd = self.hosts.etcd
        elif kind.etcd == "cluster":
            self.etcd_cluster = EmbeddedEtcdCluster(3).start()
        elif launcher == "elastic":
            self.etcd = EmbeddedEtcd().start()

    @property
    def endpoint(self) -> str:
        return self.etcd_cluster.endpoints if self.etcd_cluster else self.etcd.endpoint

    def etcd_config(self):
        return self.etcd_cluster.config() if self.etcd_cluster else self.etcd.config()

    def start(self, timeout: float) -> None:
        """Host 0 first (it becomes the coordinator, or hosts torchrun's store), then the rest."""
        self._start_agent(0)
        if self.launcher == "elastic":
            ready = lambda: self._read(JobKeys(self.job_id).coordinator)  # noqa: E731
        elif self.hosts is not None:
            ready = lambda: _accepts(self.hosts[0].addr, TORCHRUN_PORT)  # noqa: E731
        else:
            ready = lambda: True  # noqa: E731 - torchrun's agents on loopback retry the store themselves
        if not harness.wait_for(ready, timeout, interval=0.2):
            raise RuntimeError(f"host 0's agent was not ready within {timeout:g}s")
        for index in range(1, self.host_count):
            self._start_agent(index)

    def _start_agent(self, index: int) -> None:
        workload = ["--steps", "1000000", "--timing-dir", str(self.timing_dir)]
        nproc, total = WORKERS_PER_HOST, WORKERS_PER_HOST * self.host_count
        env = harness.benchmark_env()
        host = self.hosts[index] if self.hosts is not None else None
        if self.launcher == "elastic":
            command = [str(harness.BIN / "elastic-run"), "--rdzv-endpoint", self.endpoint, "--job-id", self.job_id,
                       "--host-id", f"h{index}", "--nproc-per-node", str(nproc), "--min-np", str(nproc),
                       "--max-np", str(total), "--log-dir", str(self.log_dir),
                       *(["--host-addr", host.addr] if host else []),
                       "-m", harness.WORKLOAD_MODULE, "--mode", "elastic", *workload, "--commit-every", "1"]
        else:
            store_host = self.hosts[0].addr if host else "127.0.0.1"
            command = [str(harness.BIN / "torchrun"), f"--nnodes=1:{self.host_count}", f"--nproc-per-node={nproc}",
                       "--rdzv-backend=c10d", f"--rdzv-endpoint={store_host}:{TORCHRUN_PORT}",
                       f"--rdzv-id={self.job_id}", "--max-restarts=3",
                       # torchrun guesses whether it hosts the store from the host name, which
                       # resolves to loopback in a namespace: say so.
                       *([f"--local-addr={host.addr}", f"--rdzv-conf=is_host={int(index == 0)}"] if host else []),
                       "-m", harness.WORKLOAD_MODULE, "--mode", "torchrun", *workload,
                       "--checkpoint", str(self.workdir / "ckpt.pt"), "--checkpoint-every", "20"]
            if self.launcher == "torchrun-noshare":
                env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            if host:
                env["GLOO_SOCKET_IFNAME"] = host.ifname
        if host:
            command = host.command(command)
        self.jobs.append(harness.Job(command, env, self.workdir / f"agent{index}.log"))

    def _read(self, key: str):
        with Etcd(dataclasses.replace(self.etcd_config(), call_timeout=1.0, retry_deadline=2.0)) as client:
            found = client.get(key)
        return found.value if found else None

    def close(self) -> None:
        for job in self.jobs:
            job.stop(grace=2.0)
        if self.etcd_cluster is not None:
            self.etcd_cluster.stop()
        elif self.etcd is not None and self.hosts is None:
            self.etcd.stop()
        if self.hosts is not None:
            self.hosts.destroy()

    # -- who is where

    def workers(self) -> list[harness.WorkerTimings]:
        return harness.read_timings(self.timing_dir)

    def host_of(self, pid: int) -> Optional[int]:
        for index, job in enumerate(self.jobs):
            if pid in harness.descendants(job.proc.pid):
                return index
        return None

    def coordinator_host(self) -> Optional[int]:
        """The host index of elastic-run's coordinator (from etcd); None for torchrun."""
        if self.launcher != "elastic":
            return 0  # torchrun's c10d store lives in host 0's agent
        keys = JobKeys(self.job_id)
        member_id = self._read(keys.coordinator)
        member = member_id and self._read(keys.member(member_id.decode()))
        return int(json.loads(member)["host"][1:]) if member else None

    def running(self) -> bool:
        return all(job.running() for job in self.jobs)

    def warmed_up(self, steps: int) -> bool:
        workers = self.workers()
        return len(workers) >= WORKERS_PER_HOST * self.host_count and all(len(w.steps) >= steps for w in workers)


def _accepts(addr: str, port: int) -> bool:
    """Whether something listens at addr:port (the root namespace reaches every host's address)."""
    try:
        socket.create_connection((addr, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def inject(cluster: Cluster, rng: random.Random, outage_s: float) -> Fault:
    """Make the fault of cluster.kind now; return when it was made (and undone, for outages)."""
    name = cluster.kind.name
    if name in ("crash", "hang"):
        ours = set().union(*(harness.descendants(job.proc.pid) for job in cluster.jobs))
        candidates = [w for w in cluster.workers() if w.rank != 0 and w.pid in ours]
        victim = rng.choice(candidates)
        now = time.time()
        os.kill(victim.pid, signal.SIGKILL if name == "crash" else signal.SIGSTOP)
        return Fault(now, now, {victim.pid}, {"victim_rank": victim.rank, "victim_host": cluster.host_of(victim.pid)})
    if name == "host-kill-rank0":
        target = next(cluster.host_of(w.pid) for w in cluster.workers() if w.rank == 0)
        agent = cluster.jobs[target].proc.pid
        victims, coordinator = harness.descendants(agent), cluster.coordinator_host()
        now = time.time()
        for pid in (agent, *victims):  # listed first: a worker must not outlive its agent unseen
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return Fault(now, now, victims, {"killed_host": target, "coordinator_host": coordinator})
    if name.startswith("partition"):
        rank0 = next((cluster.host_of(w.pid) for w in cluster.workers() if w.rank == 0), None)
        coordinator = cluster.coordinator_host()
        if name == "partition-rank0":
            target = rank0
        else:
            target = next(i for i in range(cluster.host_count) if i not in (rank0, coordinator))
        host = cluster.hosts[target]
        victims = harness.descendants(cluster.jobs[target].proc.pid)
        now = time.time()
        host.cut()
        return Fault(now, now, victims, {"cut_host": target, "rank0_host": rank0, "coordinator_host": coordinator},
                     undo=host.heal)
    if name == "etcd-leader-kill":
        leader = cluster.etcd_cluster.leader()
        now = time.time()
        leader.kill()
        return Fault(now, now, set(), {"killed_member": leader._name})
    server = cluster.etcd
    now = time.time()
    if name == "etcd-outage":
        server.kill()
        time.sleep(outage_s)  # the fault's duration, not a wait for an event
        server.restart()
    else:
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(outage_s)
        os.kill(server.pid, signal.SIGCONT)
    return Fault(now, time.time(), set(), {"outage_s": outage_s})


def step_window(workers: list[harness.WorkerTimings]) -> float:
    """The median step time: a step completing this soon after a fault was in flight at it."""
    medians = [m for w in workers if (m := harness.median_step_time(w.steps, warmup=5)) is not None]
    return statistics.median(medians) if medians else 0.0


def next_step(workers: list[harness.WorkerTimings], fault: Fault) -> dict:
    """Fault -> the first step a worker outside the victims completed after the fault.

    A survivor may still complete the step that was in flight at the fault; a first
    completion within one median step of the fault that is that worker's next step
    number is not a recovery and is skipped (as in benchmarks.harness.measure_recovery).
    """
    window = step_window(workers)
    last_before = max((s[0] for w in workers for s in w.steps if s[1] <= fault.time), default=0)
    firsts = []
    for w in workers:
        if w.pid in fault.victims:
            continue
        prior = [s for s in w.steps if s[1] <= fault.time]
        after = [s for s in w.steps if s[1] > fault.time]
        if after and prior and after[0][0] == prior[-1][0] + 1 and after[0][1] - fault.time < window:
            after = after[1:]
        if after:
            firsts.append(after[0])
    if not firsts:
        return {"recovered": False, "last_step_before": last_before}
    step, when = min(firsts, key=lambda s: s[1])
    return {"recovered": True, "fault_to_next_step_s": when - fault.time, "last_step_before": last_before,
            "first_step_after": step, "steps_rerun": max(0, last_before - (step - 1))}


def longest_pause(workers: list[harness.WorkerTimings], fault: Fault, settle_s: float) -> dict:
    """The longest gap between two consecutive steps of any worker around the fault."""
    start, end = fault.time - 1.0, fault.end + settle_s
    gaps = [b[1] - a[1] for w in workers for a, b in zip(w.steps, w.steps[1:]) if b[1] >= start and a[1] <= end]
    rerun = [a[0] - b[0] + 1 for w in workers for a, b in zip(w.steps, w.steps[1:]) if b[0] <= a[0]]
    stepped_after = any(s[1] > fault.end for w in workers for s in w.steps)
    return {"longest_pause_s": max(gaps, default=None), "median_step_s": step_window(workers),
            "steps_rerun": sum(rerun), "stepped_after": stepped_after}


def reformations(events_path: Path, after: float) -> int:
    """Rounds the workers switched to after `after` (reform_done events, one round counted once)."""
    if not events_path.exists():
        return 0
    rounds = set()
    for line in events_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "reform_done" and event.get("time", 0) > after:
            rounds.add(event.get("round"))
    return len(rounds)
