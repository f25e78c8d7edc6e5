"""Rendezvous at scale: time to form a round with N hosts on one etcd, and its etcd traffic.

    python -m benchmarks.rendezvous [--sizes 4,16,64,256,1024] [--json PATH]

Targets (docs): 256 hosts <= 1 s, 1024 hosts <= 3 s, and next 4096 hosts <= 2 s, from
"all registered" to "plan visible to every watcher"; etcd requests per round O(N).

What is real and what is simulated (the output says it again, per size):

- one etcd (embedded), the real `Coordinator` inside a real `Participant` (host 0),
  plus up to --real-members more full Participants (own client, lease, control
  watch, campaign), which give the per-host request cost of a real agent;
- the other hosts are simulated: their member keys are put by one registrar
  client on ONE shared lease (a real agent has a lease of its own, and also does
  a get, a campaign and a control watch: see "real host requests" below), from a
  few threads, as hosts registering at the same moment would;
- for every simulated host, one real `Watch` stream on control/plan (the project's
  Watch class, one thread and one gRPC stream each, over --watch-clients
  channels), capped at --watch-streams (default 256); hosts beyond the cap have
  no watcher and are reported as such. All watchers live in this one process, so
  their fan-out is bounded by its GIL and thread count, not by etcd: on 2 cores,
  1020 streams (over 2000 threads) starved the process for tens of seconds, which
  measures the simulation, not the rendezvous. Use --watch-streams 0 to time the
  coordinator alone. For the same reason a simulated watcher reads only the round
  number at the head of the plan it receives: a real agent parses the whole plan
  (4.4 ms at 4096 hosts, in parallel with every other host), but 256 parses in one
  process take a second of GIL in turn. The real participants parse it whole.

Times: "all registered -> plan everywhere" starts when the last registration put
returned and ends when every watcher and every real participant has seen the
plan. "first registration -> plan" includes the registrations themselves.
Requests are `Etcd.requests` summed over every client, from before host 0
started to the plan being seen everywhere (keep-alives included).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from elastic.rendezvous import EmbeddedEtcd, Etcd, JobKeys, Member, Participant, RendezvousSettings, RoundPlan

log = logging.getLogger(__name__)

TARGETS = {256: 1.0, 1024: 3.0, 4096: 2.0}  # seconds, all registered -> plan everywhere


@dataclass(frozen=True)
class Result:
    hosts: int
    real_members: int  # full Participants (host 0, the coordinator, included)
    simulated_members: int  # member keys put by the registrar on one shared lease
    watch_streams: int  # real Watch streams standing in for the simulated hosts' agents
    unwatched_hosts: int  # simulated hosts beyond --watch-streams: nobody watched for them
    register_s: float  # first registration -> last registration returned
    round_s: float  # all registered -> plan seen by every watcher and participant
    total_s: float  # first registration -> plan seen everywhere
    requests: int  # etcd requests, all clients, whole window
    requests_per_host: float
    coordinator_requests: int  # host 0's client: the leader's whole cost, join included
    real_host_requests: float  # mean requests of a real non-leading Participant (join to plan)
    world_size: int
    target_s: float | None

    @property
    def verdict(self) -> str:
        if self.target_s is None:
            return ""
        return "ok" if self.round_s <= self.target_s else "MISSED"


class PlanWatchers:
    """Real Watch streams on control/plan that note when they first see a plan of `round`."""

    def __init__(self, clients: list[Etcd], keys: JobKeys, count: int, round_number: int = 1):
        self._round = round_number
        self._lock = threading.Lock()
        self.seen_at: dict[int, float] = {}
        self.everyone = threading.Event()
        self._count = count
        self.watches = []
        for index in range(count):
            client = clients[index % len(clients)]
            self.watches.append(client.watch(keys.plan, prefix=False, start_revision=0,
                                             on_events=lambda events, i=index: self._on_events(i, events)))

    def _on_events(self, index: int, events) -> None:
        now = time.monotonic()
        for event in events:
            if event.type == "put" and _plan_round(event.kv.value) >= self._round:
                with self._lock:
                    self.seen_at.setdefault(index, now)
                    if len(self.seen_at) == self._count:
                        self.everyone.set()
                return

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for watch in self.watches:
            if not watch.ready.wait(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"watch streams not established within {timeout:g}s")
        if not self.watches:
            self.everyone.set()

    def cancel(self) -> None:
        for watch in self.watches:
            watch._stopped.set()  # stop all first: the joins below then return at once
        for watch in self.watches:
            watch.cancel()


_PLAN_HEAD = re.compile(rb'\{"round":(\d+),')


def _plan_round(value: bytes) -> int:
    """The round of a plan's JSON, read from its head (RoundPlan.to_json writes it first)."""
    head = _PLAN_HEAD.match(value)
    return int(head.group(1)) if head else RoundPlan.from_json(value).round


def _member(index: int) -> Member:
    member_id = f"host-{index:05d}"
    return Member(member_id, member_id, f"10.0.{index // 256}.{index % 256}", 29500,
                  (f"{member_id}/w0",), joined=time.time())


def run_size(server: EmbeddedEtcd, hosts: int, *, real_members: int, watch_streams: int, watch_clients: int,
             register_threads: int, timeout: float) -> Result:
    keys = JobKeys(f"bench-{hosts}-{uuid.uuid4().hex[:8]}")
    settings = RendezvousSettings(hosts, hosts, settle=0.5, timeout=600)
    config = server.config()
    real = max(1, min(real_members, hosts))
    simulated = hosts - real
    streams = min(watch_streams, simulated)
    clients: list[Etcd] = []
    participants: list[Participant] = []
    watchers = None
    watch_pool: list[Etcd] = []
    registrar = Etcd(config)
    lease = None
    try:
        # Host 0 first, so it wins the election: its client's count is the coordinator's cost.
        seen: dict[int, float] = {}
        seen_lock = threading.Lock()

        def start_participant(index: int) -> None:
            client = Etcd(config)
            clients.append(client)
            participant = Participant(client, keys, settings, _member(index), ttl=30)

            def on_control(plan, status) -> None:
                if plan is not None and plan.round >= 1:
                    with seen_lock:
                        seen.setdefault(index, time.monotonic())

            participant.control.add_listener(on_control)
            participants.append(participant.start())

        start_participant(0)
        if not participants[0].coordinator.leading.wait(10):
            raise RuntimeError("host 0 did not become coordinator")

        watch_pool = [Etcd(config) for _ in range(min(watch_clients, max(1, streams)))]
        watchers = PlanWatchers(watch_pool, keys, streams)
        watchers.wait_ready(timeout)

        lease = registrar.grant_lease(60)
        members = [_member(index) for index in range(real, hosts)]
        # The registration window: the real followers join (one after another, in this
        # thread) while the pool puts the simulated hosts' keys.
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=register_threads) as pool:
            puts = pool.map(lambda m: registrar.put(keys.member(m.member_id), m.to_json(), lease=lease), members)
            for index in range(1, real):
                start_participant(index)
            list(puts)
        registered = time.monotonic()

        deadline = registered + timeout
        if not watchers.everyone.wait(timeout):
            raise RuntimeError(f"{hosts} hosts: only {len(watchers.seen_at)} of {streams} watchers saw a plan")
        control = participants[0].control
        if not control.wait_for(lambda p, _status: p is not None and p.round >= 1, max(0.1, deadline - time.monotonic())):
            raise RuntimeError(f"{hosts} hosts: no round formed in time")
        plan = control.plan
        while len(seen) < real and time.monotonic() < deadline:
            time.sleep(0.001)
        if len(seen) < real:
            raise RuntimeError(f"{hosts} hosts: a real participant never saw the plan")
        done = max([*watchers.seen_at.values(), *seen.values()])
        requests = registrar.requests + sum(c.requests for c in [*clients, *watch_pool])
        followers = [clients[i].requests for i in range(1, real)]
        return Result(
            hosts=hosts, real_members=real, simulated_members=simulated, watch_streams=streams,
            unwatched_hosts=simulated - streams, register_s=registered - started, round_s=done - registered,
            total_s=done - started, requests=requests, requests_per_host=requests / hosts,
            coordinator_requests=clients[0].requests,
            real_host_requests=statistics.mean(followers) if followers else float("nan"),
            world_size=plan.world_size, target_s=TARGETS.get(hosts),
        )
    finally:
        if watchers is not None:
            watchers.cancel()
        with ThreadPoolExecutor(max_workers=max(1, len(participants))) as pool:
            list(pool.map(lambda p: p.leave(), participants))
        if lease is not None:
            registrar.revoke_lease(lease)
        for kv in registrar.get_prefix(keys.prefix)[0]:
            registrar.delete(kv.key)
        registrar.close()
        for client in [*clients, *watch_pool]:
            client.close()


def print_table(results: list[Result]) -> None:
    header = (f"{'hosts':>6} {'real':>4} {'sim':>5} {'watch':>5} {'register s':>10} {'round s':>8} "
              f"{'total s':>8} {'requests':>8} {'req/host':>8} {'coord req':>9} {'real host req':>13} "
              f"{'target':>7} {'':>6}")
    print(header)
    print("-" * len(header))
    for r in results:
        target = f"<={r.target_s:g}s" if r.target_s is not None else ""
        print(f"{r.hosts:>6} {r.real_members:>4} {r.simulated_members:>5} {r.watch_streams:>5} "
              f"{r.register_s:>10.3f} {r.round_s:>8.3f} {r.total_s:>8.3f} {r.requests:>8} "
              f"{r.requests_per_host:>8.2f} {r.coordinator_requests:>9} {r.real_host_requests:>13.1f} "
              f"{target:>7} {r.verdict:>6}")
    print("\nround s = last registration returned -> plan seen by every watcher and real participant")
    print("(<= 0 for tiny N: the plan formed before the last joiner's start() returned).")
    print("Simulated hosts: member keys on one shared lease (1 put each) and one real Watch stream on")
    print("control/plan each (up to the 'watch' column); a real agent's join costs 'real host req'.")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Rendezvous round formation time and etcd traffic vs hosts")
    parser.add_argument("--sizes", default="4,16,64,256,1024", help="comma-separated host counts")
    parser.add_argument("--real-members", type=int, default=4, help="full Participants per size (host 0 leads)")
    parser.add_argument("--watch-streams", type=int, default=256, help="cap on real plan watch streams")
    parser.add_argument("--watch-clients", type=int, default=8, help="gRPC channels the watch streams share")
    parser.add_argument("--register-threads", type=int, default=8, help="threads putting simulated member keys")
    parser.add_argument("--timeout", type=float, default=60.0, help="per size, seconds")
    parser.add_argument("--json", default=None, help="write the results here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"invalid --sizes {args.sizes!r}: expected positive integers like 4,16,64")
    results = []
    with EmbeddedEtcd() as server:
        for hosts in sizes:
            result = run_size(server, hosts, real_members=args.real_members, watch_streams=args.watch_streams,
                              watch_clients=args.watch_clients, register_threads=args.register_threads,
                              timeout=args.timeout)
            results.append(result)
            print(f"{hosts} hosts: round formed in {result.round_s:.3f}s", flush=True)
    print()
    print_table(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "rendezvous", "targets_s": TARGETS,
                       "results": [{**asdict(r), "verdict": r.verdict} for r in results]}, f, indent=2)
    return 0 if all(r.verdict != "MISSED" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
