"""The chaos soak: its test bed, its faults and its checks, shared by the CI test
(``tests/chaos/test_soak.py``, 100 faults) and the benchmark (``benchmarks/soak.py``,
1,000 faults and more).

Four hosts (network namespaces on a bridge), one replaceable elastic-run agent with one
worker on each, all writing to one shared steps file; a 3-member etcd cluster on the
bridge (``rendezvous.embedded.EmbeddedEtcdCluster``). A seeded schedule applies faults
one after the other:

* ``worker_kill``: SIGKILL of a worker; its agent replaces it (--max-restarts).
* ``freeze``: SIGSTOP of a worker until its agent declares it hung and replaces it;
  then SIGCONT (too late: it is gone).
* ``pause``: SIGSTOP of a worker for 0.5 s, then SIGCONT: shorter than any hang bound
  (a stopped process's is 1 s), so nothing is re-formed.
* ``agent_kill``: SIGKILL of an agent (its worker dies with it), then a **join**: a
  new agent on the same host.
* ``link_cut``: a host lost: its cable pulled; healed once the survivors stepped; its
  agent registers again and its worker rejoins.
* ``partition``: a host cut off from the other hosts while it still reaches etcd;
  healed once the survivors stepped.
* ``leader_kill``: SIGKILL of the etcd raft leader, restarted once a step went by;
  nothing is re-formed.
* ``member_kill``: SIGKILL of an etcd follower, restarted once a step went by; nothing
  is re-formed.

Each fault is recovered from (a step of the full 4-worker ring after it) before the
next, every wait bounded. The job uses float64 and a global batch of 24 rows split
evenly at any world of 1 to 4, so its trajectory is that of a single process whatever
the faults: it must end equal to a single-process reference. Leaks are checked at the
end: processes, the long-lived agents' descriptors and threads, the job's etcd keys,
the agents' private files.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from elastic.rendezvous.embedded import EmbeddedEtcdCluster
from tests.fakes.jobs import REPO, TRAIN_JOB, poll, read_jsonl, wait_until
from tests.fakes.steps import missing_steps, step_attempts, steps_run_again

HOSTS = 4
TTL = 6.0
KINDS = ("worker_kill", "freeze", "pause", "agent_kill", "link_cut", "partition", "leader_kill", "member_kill")
FAILURES = {"worker_kill", "freeze", "agent_kill", "link_cut", "partition"}  # a worker is lost: one step may re-run
# Faults that last longer than the 2 s recovery bound by their nature: a hang is declared
# only after the hang bound (5 s here), a host cut off or partitioned only after its
# lease's TTL (6 s) or the peer probe. Every other fault must be recovered within 2 s.
LONG_FAULTS = {"freeze", "link_cut", "partition"}
# float64: the ring sums partial gradients in another order than one process, and SGD with
# momentum carries that rounding forward step by step. A fault-free control of this script
# at world 4 ended 2.43e-11 from one process after 33,357 steps (about 7e-16 a step), while
# a lost or repeated step moves a parameter by about 1e-3. So the bound grows with the run:
# 1e-15 a step, never under 1e-12 (CI's 100 faults: about 3,000 steps, 3e-12).
MAX_DIFF = 1e-12
MAX_DIFF_PER_STEP = 1e-15


def max_diff(steps: int) -> float:
    """How far a run of ``steps`` steps may end from one process, in float64."""
    return max(MAX_DIFF, MAX_DIFF_PER_STEP * steps)
STEPS = 200000  # never reached: the run stops the job; sizes the synthetic data set
SCRIPT = ["--steps", str(STEPS), "--dataset-size", str(STEPS * 24), "--global-batch", "24", "--float64",
          "--step-delay", "0.05"]
RECOVERY_S = 120  # bound on each wait: generous for a loaded 2-core machine


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
        """Live descendants of the agent (its workers, and the template that forks them:
        warm starts make a worker the agent's grandchild). ``ip netns exec`` execs, so the
        agent's pid is the Popen's."""
        found, parents = [], [self.pid]
        while parents:
            parent = parents.pop()
            for task in Path(f"/proc/{parent}/task").glob("*"):
                try:
                    children = [int(p) for p in (task / "children").read_text().split()]
                except OSError:
                    continue
                found += children
                parents += children
        return found


class Fleet:
    """One agent per host, replaceable; every worker appends to ``out/steps.jsonl``."""

    def __init__(self, hosts, cluster: EmbeddedEtcdCluster, tmp: Path, launcher: list[str], script: list[str]):
        self.hosts, self.cluster, self.tmp = hosts, cluster, tmp
        self.out = tmp / "out"
        self.private = tmp / "private"  # the agents' private directories: none may be left
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
        agent = Agent(host, host.job(work, args, name="agent", env={"ELASTIC_PRIVATE_ROOT": str(self.private)}),
                      generation)
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


# -- the faults ------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    host: str
    at: float  # seconds since the job's first step
    detect_s: Optional[float]
    next_step_s: float  # fault (or its end, for a pause) -> the next step of any worker
    next_world: int
    full_s: float  # fault -> first step of the whole 4-worker ring again
    reformed: bool

    def line(self, number: int) -> str:
        detect = "-" if self.detect_s is None else f"{self.detect_s:.2f}s"
        return (f"fault {number:4d} {self.kind:<11} {self.host:<14} at {self.at:7.1f}s: detected {detect:>6}, "
                f"next step {self.next_step_s:5.2f}s (world {self.next_world}), "
                f"world {HOSTS} again {self.full_s:5.2f}s{'' if self.reformed else ', not re-formed'}")


def schedule(rng: random.Random, count: int) -> list[str]:
    """Every kind at least twice (when count allows), the rest random, shuffled."""
    kinds = [k for k in KINDS for _ in range(2)][:count]
    kinds += [rng.choice(KINDS) for _ in range(count - len(kinds))]
    rng.shuffle(kinds)
    return kinds


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # already gone (SIGCONT after the hang verdict killed it)


class Soak:
    def __init__(self, fleet: Fleet, cluster: EmbeddedEtcdCluster, rng: random.Random):
        self.fleet, self.cluster, self.rng = fleet, cluster, rng
        self.problems: list[str] = []
        self.t_start = 0.0

    def newest(self) -> dict:
        return max(self.fleet.steps(), key=lambda s: s["t"])

    def first_step(self, after: float, what: str, *, world: Optional[int] = None, min_round: int = 0) -> dict:
        def found():
            hits = [s for s in self.fleet.steps()
                    if s["t"] > after and s["round"] >= min_round and (world is None or s["world"] == world)]
            return min(hits, key=lambda s: s["t"]) if hits else None
        return wait_until(found, RECOVERY_S, what, interval=0.05)

    def first_event(self, after: float, names: tuple[str, ...]) -> Optional[float]:
        times = [e["time"] for e in self.fleet.events(after) if e["event"] in names]
        return min(times) - after if times else None

    def train_a_little(self) -> None:
        """A few steps of the whole ring between faults: commits to roll back to."""
        target = self.newest()["step"] + self.rng.randint(2, 6)
        wait_until(lambda: max(s["step"] for s in self.fleet.steps()) >= target, RECOVERY_S, f"step {target}",
                   interval=0.05)

    def _etcd_fault(self, kind: str) -> tuple[str, Optional[float], dict]:
        leader = self.cluster.leader() or self.cluster.wait_leader(30)
        assert leader is not None, "the etcd cluster has no leader"
        victim = leader if kind == "leader_kill" else \
            self.rng.choice([m for m in self.cluster.members if m is not leader and m.running])
        t0 = time.time()
        victim.kill()
        detect_s = None
        if kind == "leader_kill":
            new_leader = self.cluster.wait_leader(30, not_=victim)
            detect_s = time.time() - t0 if new_leader else None
        nxt = self.first_step(t0, f"a step after the etcd {kind}")
        victim.restart(timeout=60)
        return f"etcd-{victim.name}", detect_s, nxt

    def apply(self, kind: str) -> Outcome:
        index = self.rng.randrange(HOSTS)
        host = self.fleet.hosts[index]
        self.train_a_little()
        r0 = self.newest()["round"]
        t0 = time.time()
        detect_s = None
        if kind in ("leader_kill", "member_kill"):
            host_name, detect_s, nxt = self._etcd_fault(kind)
        else:
            agent = self.fleet.agents[index]
            host_name = host.name
            pid = wait_until(lambda: self.fleet.ring_pid(index), RECOVERY_S, f"{host.name}'s worker in the ring")
            t0 = time.time()
            if kind == "worker_kill":
                _signal(pid, signal.SIGKILL)
                nxt = self.first_step(t0, "the survivors' next step", min_round=r0 + 1)
                detect_s = self.first_event(t0, ("failure_detected",))
            elif kind == "freeze":
                _signal(pid, signal.SIGSTOP)
                wait_until(lambda: self.first_event(t0, ("hang_detected",)) is not None, RECOVERY_S,
                           f"the frozen worker {pid} to be declared hung")
                _signal(pid, signal.SIGCONT)
                detect_s = self.first_event(t0, ("hang_detected",))
                nxt = self.first_step(t0, "the survivors' next step", min_round=r0 + 1)
            elif kind == "pause":
                _signal(pid, signal.SIGSTOP)
                time.sleep(0.5)  # the fault itself lasts 0.5 s: not a synchronisation
                t0 = time.time()  # recovery counts from its end
                _signal(pid, signal.SIGCONT)
                nxt = self.first_step(t0, "a step after the pause")
            elif kind == "agent_kill":
                _signal(agent.pid, signal.SIGKILL)
                agent.job.proc.wait(30)
                nxt = self.first_step(t0, "the survivors' next step", min_round=r0 + 1)
                detect_s = self.first_event(t0, ("failure_detected",))
                self.fleet.start_agent(index)  # the join
            elif kind in ("link_cut", "partition"):
                host.cut() if kind == "link_cut" else host.cut_peers()
                nxt = self.first_step(t0, "the survivors' next step", min_round=r0 + 1)
                detect_s = self.first_event(t0, ("failure_detected",))
                host.heal()
            else:
                raise AssertionError(kind)
        full = self.first_step(nxt["t"], f"the {HOSTS}-worker ring after {kind}", world=HOSTS, min_round=nxt["round"])
        reformed = full["round"] > r0
        if kind in FAILURES and not reformed:
            self.problems.append(f"{kind} of {host_name}: no re-formation (round {r0})")
        if kind in ("pause", "leader_kill", "member_kill") and reformed:
            self.problems.append(f"{kind} of {host_name}: re-formed (round {r0} -> {full['round']})")
        return Outcome(kind, host_name, t0 - self.t_start, detect_s, nxt["t"] - t0, nxt["world"],
                       full["t"] - t0, reformed)


# -- leaks ---------------------------------------------------------------------------------


def _counts(pid: int) -> Optional[tuple[int, int]]:
    try:
        return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None


def _thread_names(pid: int) -> dict[str, int]:
    """How many threads of ``pid`` carry each name (the kernel's ``comm``, 15 characters):
    what a grown count is made of."""
    names: dict[str, int] = {}
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
            names[name] = names.get(name, 0) + 1
    except OSError:
        pass
    return names


def _names_added(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Thread names whose count changed from ``before`` to ``after``, by how much."""
    return {n: after.get(n, 0) - before.get(n, 0) for n in sorted({*before, *after})
            if after.get(n, 0) != before.get(n, 0)}


def _processes_of(marker: str) -> list[int]:
    """Live processes whose command line names ``marker`` (the run's directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def _coordinator_pid(cluster: EmbeddedEtcdCluster, job_id: str) -> Optional[int]:
    """The pid of the agent that leads the job now (its member id is ``host-pid-suffix``),
    None when it cannot be read."""
    from elastic.rendezvous import Etcd

    try:
        with Etcd(cluster.config(retry_deadline=5.0)) as etcd:
            kv = etcd.get(f"/elastic/{job_id}/coordinator")
        return int(kv.value.decode().rsplit("-", 2)[1]) if kv is not None else None
    except Exception:  # a fault's etcd member still down, a key mid-change: role unknown
        return None


def _job_keys(cluster: EmbeddedEtcdCluster, job_id: str) -> list[str]:
    from elastic.rendezvous import Etcd

    prefix = f"/elastic/{job_id}/"
    with Etcd(cluster.config()) as etcd:
        kvs, _ = etcd.get_prefix(prefix)
    return [kv.key[len(prefix):] for kv in kvs]


# -- a whole run ---------------------------------------------------------------------------


COORDINATOR_THREADS = 8  # the leading agent's loop and watch streams: 6-7 threads measured
STORE_DESCRIPTORS = 16  # rank 0's agent serves every worker's store connection
OTHER_THREADS = 4


@dataclass(frozen=True)
class AgentComparison:
    settled_at: int  # the fault number of the sample compared with
    settled: tuple[int, int]  # (descriptors, threads) then
    last_at: int
    last: tuple[int, int]
    role_threads: int  # allowed for a role taken since (leading now, in no settled sample)

    @property
    def grown(self) -> bool:
        return (self.last[0] > self.settled[0] + STORE_DESCRIPTORS
                or self.last[1] > self.settled[1] + OTHER_THREADS + self.role_threads)


def compare_agents(samples: dict[int, list[tuple[int, tuple[int, int], Optional[bool]]]]
                   ) -> dict[int, AgentComparison]:
    """Each agent that lived 30 faults or more: its last (descriptors, threads) against the
    first sample 10 faults into its life and 20 or more before its last in the same role
    (leading the job, or not); else against the first of them with the role's threads
    allowed for. ``samples``: pid -> [(fault number, counts, leads or None when unknown)]."""
    compared = {}
    for pid, seen in samples.items():
        last = seen[-1]
        if last[0] - seen[0][0] < 30:
            continue
        # (An agent unsampled through that window, /proc unreadable: its first sample 10 in.)
        settled = ([s for s in seen if seen[0][0] + 10 <= s[0] <= last[0] - 20]
                   or [next(s for s in seen if s[0] >= seen[0][0] + 10)])
        alike = [s for s in settled if s[2] is not None and s[2] == last[2]]
        first = alike[0] if alike else settled[0]
        role = COORDINATOR_THREADS if not alike and last[2] else 0
        compared[pid] = AgentComparison(first[0], first[1], last[0], last[1], role)
    return compared


def launcher(job_id: str) -> list[str]:
    return ["--job-id", job_id, "--nproc-per-node", "1", "--min-np", "2", "--max-np", str(HOSTS),
            "--rdzv-ttl", str(TTL), "--collective-timeout", "30", "--max-restarts", "100000",
            "--max-resets", "100000"]


def run_soak(hosts, cluster: EmbeddedEtcdCluster, tmp: Path, faults: int, seed: int,
             say: Callable[[str], None] = print, job_id: str = "soak") -> dict:
    """Apply ``faults`` faults of the seeded schedule, stop the job and check it; a dict
    of figures and ``problems`` (empty: every check held)."""
    rng = random.Random(seed)
    kinds = schedule(rng, faults)
    say(f"soak: seed {seed} (SOAK_SEED={seed} replays it), {faults} faults")
    fleet = Fleet(hosts, cluster, tmp, launcher(job_id), SCRIPT)
    began = time.monotonic()
    for index in range(HOSTS):
        fleet.start_agent(index)
    soak = Soak(fleet, cluster, rng)
    first = soak.first_step(0, f"the first step of the {HOSTS}-worker ring", world=HOSTS)
    soak.t_start = first["t"]
    startup_s = time.monotonic() - began
    outcomes: list[Outcome] = []
    # Descriptors and threads of every agent after each fault: an agent that lived through
    # 30 faults or more must hold no more at its end than 10 faults into its life, in the
    # same role. The agent that leads the job runs the coordinator's loop and its watch
    # streams (6-7 threads more; leadership moves both ways), so its last count is set
    # against a sample in which it led too, or not, alike; rank 0's agent serves every
    # worker's store connection, hence +16 descriptors, and +4 threads for the rest.
    samples: dict[int, list[tuple[int, tuple[int, int], Optional[bool]]]] = {}
    names: dict[tuple[int, int], dict[str, int]] = {}  # (pid, fault number): thread names then
    try:
        for number, kind in enumerate(kinds, 1):
            outcomes.append(soak.apply(kind))
            say(outcomes[-1].line(number))
            leader = _coordinator_pid(cluster, job_id)
            for agent in fleet.agents.values():
                counts = _counts(agent.pid) if agent.job.proc.poll() is None else None
                if counts is not None:
                    samples.setdefault(agent.pid, []).append(
                        (number, counts, None if leader is None else agent.pid == leader))
                    names[agent.pid, number] = _thread_names(agent.pid)
    finally:
        fleet.stop_file.touch()  # also after a failed wait: the agents then end on their own
    faults_s = time.monotonic() - began - startup_s
    problems = list(soak.problems)
    for agent in fleet.agents.values():
        code = agent.job.wait(180)
        if code != 0:
            problems.append(f"{agent.host.name}: exit {code}: {agent.job.text()[-1500:]}")
    elapsed = time.monotonic() - began

    steps = fleet.steps()
    last = max(s["step"] for s in steps)
    rounds = fleet.rounds()
    final_round = max(e["round"] for e in rounds)
    final_pids = {e["pid"] for e in rounds if e["round"] == final_round}
    import torch

    finals = {p: torch.load(fleet.out / f"final-{p}.pt", weights_only=True)
              for p in final_pids if (fleet.out / f"final-{p}.pt").exists()}
    reference_began = time.monotonic()
    reference = single_process_reference(tmp / "reference", SCRIPT, last)
    reference_s = time.monotonic() - reference_began
    worst = max((value - finals[p][name]).abs().max().item() for p in finals for name, value in reference.items())
    equal = all(torch.equal(value, finals[p][name]) for p in finals for name, value in reference.items())
    attempts = step_attempts(steps)
    rerun = steps_run_again(attempts)
    failures = sum(1 for o in outcomes if o.kind in FAILURES)
    if len(finals) != HOSTS:
        problems.append(f"final parameters of {sorted(finals)} only, round {final_round} had {final_pids}")
    if worst > max_diff(last):
        problems.append(f"max |param - reference| {worst:.2e}")
    if missing_steps(attempts, last):
        problems.append("a committed step is missing")
    if rerun > failures:
        problems.append(f"{rerun} steps re-run for {failures} failures")
    if [e for e in fleet.events() if e.get("user_error")]:
        problems.append("a fault was taken for a user error")
    # Leaks: no process of the run left, the long-lived agents' descriptors and threads
    # flat, the job's keys bounded, no private directory left behind.
    poll(lambda: not _processes_of(str(fleet.out)), 30, 0.2)
    leaks = {"processes": _processes_of(str(fleet.out)), "keys": len(_job_keys(cluster, job_id))}
    poll(lambda: not any(fleet.private.glob("*/*")), 30, 0.2)
    leaks["private_dirs"] = sorted(p.name for p in fleet.private.glob("*/*"))
    compared = compare_agents(samples)
    grown = {p: c for p, c in compared.items() if c.grown}
    leaks["agents_grown"] = {str(p): (c.settled, c.last) for p, c in grown.items()}
    leaks["threads_changed"] = {str(p): _names_added(names[p, c.settled_at], names[p, c.last_at])
                                for p, c in compared.items()}
    leaks["agents_compared"] = {str(p): (c.settled, c.last) for p, c in compared.items()}
    if leaks["processes"] or leaks["private_dirs"] or grown or leaks["keys"] > 64:
        problems.append(f"leaks: {leaks}")

    by_kind = {}
    for kind in KINDS:
        mine = [o for o in outcomes if o.kind == kind]
        if mine:
            recoveries = [o.next_step_s for o in mine]
            by_kind[kind] = {"count": len(mine), "recovered": len(mine), "median_s": statistics.median(recoveries),
                             "max_s": max(recoveries), "full_max_s": max(o.full_s for o in mine),
                             "over_2s": sum(1 for r in recoveries if r > 2.0), "lasts_longer": kind in LONG_FAULTS}
    over = {k: v["over_2s"] for k, v in by_kind.items() if v["over_2s"] and not v["lasts_longer"]}
    if over:
        problems.append(f"recoveries over 2 s of faults that last less: {over}")
    return {"seed": seed, "faults": len(outcomes), "steps": last, "rerun": rerun, "failures": failures,
            "max_abs_diff": worst, "float64_equal": equal, "final_world": len(final_pids),
            "elapsed_s": elapsed, "startup_s": startup_s, "faults_s": faults_s, "reference_s": reference_s,
            "load_average": os.getloadavg()[0], "by_kind": by_kind, "leaks": leaks, "problems": problems,
            "outcomes": [asdict(o) for o in outcomes]}
