"""Chaos soak: random faults, one after the other, on four namespaced hosts.

Four hosts (network namespaces on a bridge), one elastic-run agent with one worker
on each, a 3-member etcd cluster on the bridge. A seeded schedule (the seed is
printed; ``SOAK_SEED`` replays it, ``SOAK_FAULTS`` sets the count) applies faults:

* ``worker_kill``: SIGKILL of a worker; its agent replaces it (--max-restarts).
* ``freeze``: SIGSTOP of a worker until its agent declares it hung and replaces it;
  then SIGCONT (too late: it is gone).
* ``pause``: SIGSTOP of a worker for 2 s, then SIGCONT: shorter than any hang bound,
  so nothing is re-formed.
* ``agent_kill``: SIGKILL of an agent (its worker dies with it), then a **join**: a
  new agent on the same host.
* ``link_cut``: a host's cable pulled; healed once the survivors stepped; its agent
  registers again and its worker rejoins.
* ``leader_kill``: SIGKILL of the etcd raft leader, restarted once a step went by;
  nothing is re-formed.

Each fault is recovered from (a step of the full 4-worker ring after it) before the
next, every wait bounded. One summary line per fault: kind, detection time (first
failure event, hang verdict or new raft leader), time to the next step. The job
uses float64 and a global batch of 24 rows split evenly at any world of 1 to 4, so
its trajectory is that of a single process whatever the faults: it must end equal
to a single-process reference (1e-9), with every step from 1 to the last present
and at most one step re-run per failure (commit every step), every agent exit 0.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from elastic.rendezvous.embedded import EmbeddedEtcdCluster
from tests.chaos.soak_bed import Fleet, single_process_reference
from tests.fakes.jobs import wait_until
from tests.fakes.steps import missing_steps, step_attempts, steps_run_again

HOSTS = 4
FAULTS = int(os.environ.get("SOAK_FAULTS", "20"))
# The budget for the whole soak (faults, start-up, stop and the reference run),
# asserted. 20 faults took 137 s at load 2.9 (faults about 6 s apart) and 248 s at load
# 7.8 (other suites running; replacements slower to join), so 10 minutes leaves 2.4x
# over the worst seen. More faults (SOAK_FAULTS) get proportionally more.
BUDGET_S = 600.0 * max(1.0, FAULTS / 20)
# The budget, plus building and removing the bed (namespaces, a 3-member etcd cluster).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUDGET_S + 120)]

TTL = 6.0
KINDS = ("worker_kill", "freeze", "pause", "agent_kill", "link_cut", "leader_kill")
FAILURES = {"worker_kill", "freeze", "agent_kill", "link_cut"}  # a worker is lost: one step may re-run
STEPS = 20000  # never reached: the test stops the job; sizes the synthetic data set
SCRIPT = ["--steps", str(STEPS), "--dataset-size", str(STEPS * 24), "--global-batch", "24", "--float64",
          "--step-delay", "0.05"]
LAUNCHER = ["--job-id", "soak", "--nproc-per-node", "1", "--min-np", "2", "--max-np", str(HOSTS),
            "--rdzv-ttl", str(TTL), "--collective-timeout", "30", "--max-restarts", "100",
            "--max-resets", "200"]
RECOVERY_S = 120  # bound on each wait: generous for a loaded 2-core machine


@dataclass
class Outcome:
    kind: str
    host: str
    at: float  # seconds since the job's first step
    detect_s: Optional[float]
    next_step_s: float
    next_world: int
    full_s: float  # fault -> first step of the whole 4-worker ring again
    reformed: bool

    def line(self, number: int) -> str:
        detect = "-" if self.detect_s is None else f"{self.detect_s:.2f}s"
        return (f"fault {number:2d} {self.kind:<11} {self.host:<14} at {self.at:6.1f}s: detected {detect:>6}, "
                f"next step {self.next_step_s:5.2f}s (world {self.next_world}), "
                f"world {HOSTS} again {self.full_s:5.2f}s{'' if self.reformed else ', not re-formed'}")


def schedule(rng: random.Random, count: int) -> list[str]:
    """Every kind at least twice (when count allows), the rest random, shuffled."""
    kinds = [k for k in KINDS for _ in range(2)][:count]
    kinds += [rng.choice(KINDS) for _ in range(count - len(kinds))]
    rng.shuffle(kinds)
    return kinds


class Soak:
    def __init__(self, fleet: Fleet, cluster: EmbeddedEtcdCluster, rng: random.Random):
        self.fleet, self.cluster, self.rng = fleet, cluster, rng
        self.problems: list[str] = []
        self.t_start = 0.0

    # -- watching the shared steps file

    def newest(self) -> dict:
        return max(self.fleet.steps(), key=lambda s: s["t"])

    def first_step(self, after: float, what: str, *, world: Optional[int] = None, min_round: int = 0) -> dict:
        def found():
            hits = [s for s in self.fleet.steps()
                    if s["t"] > after and s["round"] >= min_round and (world is None or s["world"] == world)]
            return min(hits, key=lambda s: s["t"]) if hits else None
        return wait_until(found, RECOVERY_S, what, interval=0.1)

    def first_event(self, after: float, names: tuple[str, ...]) -> Optional[float]:
        times = [e["time"] for e in self.fleet.events(after) if e["event"] in names]
        return min(times) - after if times else None

    # -- one fault

    def train_a_little(self) -> None:
        """A few steps of the whole ring between faults: commits to roll back to."""
        target = self.newest()["step"] + self.rng.randint(3, 12)
        wait_until(lambda: max(s["step"] for s in self.fleet.steps()) >= target, RECOVERY_S, f"step {target}",
                   interval=0.1)

    def apply(self, kind: str) -> Outcome:
        index = self.rng.randrange(HOSTS)
        host = self.fleet.hosts[index]
        self.train_a_little()
        r0 = self.newest()["round"]
        detect_s = None
        if kind == "leader_kill":
            victim = self.cluster.leader() or self.cluster.wait_leader(30)
            assert victim is not None, "the etcd cluster has no leader"
            host_name = f"etcd-{victim.name}"
            t0 = time.time()
            victim.kill()
            new_leader = self.cluster.wait_leader(30, not_=victim)
            detect_s = time.time() - t0 if new_leader else None
            nxt = self.first_step(t0, "a step after the etcd leader kill")
            victim.restart(timeout=60)
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
                time.sleep(2.0)  # the fault itself lasts 2 s: not a synchronisation
                resumed = time.time()
                _signal(pid, signal.SIGCONT)
                nxt = self.first_step(resumed, "a step after the pause")
            elif kind == "agent_kill":
                _signal(agent.pid, signal.SIGKILL)
                agent.job.proc.wait(30)
                nxt = self.first_step(t0, "the survivors' next step", min_round=r0 + 1)
                detect_s = self.first_event(t0, ("failure_detected",))
                self.fleet.start_agent(index)  # the join
            elif kind == "link_cut":
                host.cut()
                nxt = self.first_step(t0, "the survivors' next step", min_round=r0 + 1)
                detect_s = self.first_event(t0, ("failure_detected",))
                host.heal()
            else:
                raise AssertionError(kind)
        full = self.first_step(nxt["t"], f"the {HOSTS}-worker ring after {kind}", world=HOSTS, min_round=nxt["round"])
        reformed = full["round"] > r0
        if kind in FAILURES and not reformed:
            self.problems.append(f"{kind} of {host_name}: no re-formation (round {r0})")
        if kind in ("pause", "leader_kill") and reformed:
            self.problems.append(f"{kind} of {host_name}: re-formed (round {r0} -> {full['round']})")
        return Outcome(kind, host_name, t0 - self.t_start, detect_s, nxt["t"] - t0, nxt["world"],
                       full["t"] - t0, reformed)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # already gone (SIGCONT after the hang verdict killed it)


@pytest.fixture
def etcd_cluster(netns_hosts, tmp_path):
    hosts = netns_hosts(HOSTS, etcd=False)
    cluster = EmbeddedEtcdCluster(3, host=hosts.bridge_addr, log_dir=str(tmp_path))
    try:
        yield hosts, cluster.start()
    finally:
        cluster.stop()


def test_soak_random_faults_end_equal_to_single_process_training(etcd_cluster, tmp_path, capsys):
    hosts, cluster = etcd_cluster
    seed = int(os.environ.get("SOAK_SEED") or int.from_bytes(os.urandom(4), "little"))
    rng = random.Random(seed)
    kinds = schedule(rng, FAULTS)
    with capsys.disabled():
        print(f"\nsoak: seed {seed} (SOAK_SEED={seed} replays it): {' '.join(kinds)}", flush=True)

    fleet = Fleet(hosts, cluster, tmp_path, LAUNCHER, SCRIPT)
    began = time.monotonic()
    for index in range(HOSTS):
        fleet.start_agent(index)
    soak = Soak(fleet, cluster, rng)
    first = soak.first_step(0, f"the first step of the {HOSTS}-worker ring", world=HOSTS)
    soak.t_start = first["t"]
    startup_s = time.monotonic() - began

    outcomes = []
    try:
        for number, kind in enumerate(kinds, 1):
            outcome = soak.apply(kind)
            outcomes.append(outcome)
            with capsys.disabled():
                print(outcome.line(number), flush=True)
    finally:
        fleet.stop_file.touch()  # also after a failed wait: the agents then end on their own
    faults_s = time.monotonic() - began - startup_s
    for agent in fleet.agents.values():
        assert agent.job.wait(180) == 0, f"{agent.host.name}: {agent.job.text()[-3000:]}"
    elapsed = time.monotonic() - began

    steps = fleet.steps()
    last = max(s["step"] for s in steps)
    rounds = fleet.rounds()
    final_round = max(e["round"] for e in rounds)
    final_pids = {e["pid"] for e in rounds if e["round"] == final_round}
    finals = {p: torch.load(tmp_path / "out" / f"final-{p}.pt", weights_only=True)
              for p in final_pids if (tmp_path / "out" / f"final-{p}.pt").exists()}
    reference_began = time.monotonic()
    reference = single_process_reference(tmp_path / "reference", SCRIPT, last)
    reference_s = time.monotonic() - reference_began
    worst = max((value - finals[p][name]).abs().max().item()
                for p in finals for name, value in reference.items())
    # Every rank's records count: a rank 0 killed between a step's all-reduce and its
    # record leaves the step committed by the survivors, recorded under their old ranks.
    attempts = step_attempts(steps)
    rerun = steps_run_again(attempts)
    failures = sum(1 for o in outcomes if o.kind in FAILURES)
    with capsys.disabled():
        print(f"soak: seed {seed}, {len(outcomes)} faults, {last} steps, {rerun} re-run ({failures} failures), "
              f"final world {len(final_pids)}, max |param - reference| {worst:.2e}; {elapsed:.0f}s: start-up "
              f"{startup_s:.0f}s, faults {faults_s:.0f}s, stop {elapsed - startup_s - faults_s:.0f}s, "
              f"reference {reference_s:.0f}s; load average {os.getloadavg()[0]:.1f}", flush=True)

    assert not soak.problems, soak.problems
    assert elapsed + reference_s <= BUDGET_S, f"the soak took {elapsed + reference_s:.0f}s (budget {BUDGET_S:.0f}s)"
    assert len(finals) == HOSTS, f"final parameters of {sorted(finals)} only, round {final_round} had {final_pids}"
    assert worst <= 1e-9
    assert missing_steps(attempts, last) == [], "a committed step is missing"
    assert rerun <= failures, f"{rerun} steps re-run for {failures} failures"
    assert not [e for e in fleet.events() if e.get("user_error")], "a fault was taken for a user error"
