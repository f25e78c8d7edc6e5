"""The chaos soak's test bed: one replaceable elastic-run agent per namespaced host,
all writing to one shared steps file (the 3-member etcd cluster on the hosts' bridge
is a ``rendezvous.embedded.EmbeddedEtcdCluster``).

Kept apart from ``test_soak.py`` so that the test reads as the fault schedule and
its checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from elastic.rendezvous.embedded import EmbeddedEtcdCluster
from tests.fakes.jobs import REPO, TRAIN_JOB, read_jsonl


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

    def __init__(self, hosts, cluster: EmbeddedEtcdCluster, tmp: Path, launcher: list[str], script: list[str]):
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
