"""One rendezvous member in a process of its own, for tests that need real processes.

    python -m tests.fakes.members --endpoint 127.0.0.1:2379 --job J --workers 1 \
        --min-np 2 --max-np 4 --out members/a.jsonl [--go-file GO] [--ttl 2]

It runs a real `Participant` (session, member key, control channel, coordinator)
and appends one JSON object per line to --out:

    {"event": "registered", "member_id": ..., "workers": [...], "revision": N}
    {"event": "plan", "round": N, "workers": [...], "plan": <RoundPlan JSON>}
    {"event": "status", "state": ..., "reason": ...}
    {"event": "leaving"}                                           (SIGTERM seen)
    {"event": "left", "rounds_written": N, "leading": bool, "seconds": S}  (graceful exit only)

SIGTERM (or SIGINT) makes it leave gracefully: the member key is deleted at once.
SIGKILL leaves the key to expire with the lease, which is what crash tests want.
With --go-file the process starts up, then waits for that file to exist before
registering, so that many processes can be made to race for the same round.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

from elastic.rendezvous import EtcdConfig, JobKeys, Member, Participant, RendezvousSettings, new_member_id
from elastic.rendezvous.control import JobStatus
from elastic.rendezvous.rounds import RoundPlan
from tests.fakes.jsonl import read_jsonl
from tests.fakes.local_members import PlanCounting


class JsonLines:
    """Append-only JSON lines, flushed per line so a reader in another process sees them."""

    def __init__(self, path: str):
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, **record) -> None:
        with self._lock:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_records(path: Path) -> list[dict]:
    """The complete lines of an --out file (only a torn last line is skipped)."""
    return read_jsonl(path)


def plans_seen(path: Path) -> dict[int, dict]:
    """round number -> the plan (as JSON object) this member saw for it."""
    return {r["round"]: r["plan"] for r in read_records(path) if r.get("event") == "plan"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True, help="etcd HOST:PORT")
    parser.add_argument("--job", required=True, help="job id")
    parser.add_argument("--workers", type=int, default=1, help="workers this member offers")
    parser.add_argument("--min-np", type=int, required=True)
    parser.add_argument("--max-np", type=int, required=True)
    parser.add_argument("--settle", type=float, default=0.3)
    parser.add_argument("--timeout", type=float, default=30.0, help="rendezvous timeout below min_np")
    parser.add_argument("--ttl", type=float, default=5.0, help="lease TTL in seconds")
    parser.add_argument("--out", required=True, help="JSON lines file to append to")
    parser.add_argument("--member-id", default=None)
    parser.add_argument("--go-file", default=None, help="wait for this file before registering")
    parser.add_argument("--go-timeout", type=float, default=30.0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {os.getpid()} %(name)s: %(message)s")
    out = JsonLines(args.out)
    stop = threading.Event()
    # Installed before anything slow, so an early SIGTERM still means "leave".
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    if args.go_file:
        deadline = time.monotonic() + args.go_timeout
        while not os.path.exists(args.go_file):
            if stop.is_set() or time.monotonic() > deadline:
                out.write(event="no-go")
                return 2
            time.sleep(0.01)

    host = socket.gethostname()
    member_id = args.member_id or new_member_id(host)
    workers = tuple(f"{member_id}/w{i}" for i in range(args.workers))
    etcd = PlanCounting(EtcdConfig.from_string(args.endpoint, retry_deadline=30.0), JobKeys(args.job))
    participant = Participant(
        etcd,
        JobKeys(args.job),
        RendezvousSettings(args.min_np, args.max_np, settle=args.settle, timeout=args.timeout),
        Member(member_id, host, "127.0.0.1", 0, workers, joined=time.time()),
        ttl=args.ttl,
    )

    last_round = [0]
    last_status = [JobStatus()]
    seen_lock = threading.Lock()

    def on_control(plan, status) -> None:
        # Called on the control watch thread (and once from main): record each round once.
        with seen_lock:
            if plan is not None and plan.round > last_round[0]:
                last_round[0] = plan.round
                out.write(event="plan", round=plan.round, workers=list(plan.worker_ids()),
                          plan=json.loads(plan.to_json()))
            if status != last_status[0]:
                last_status[0] = status
                out.write(event="status", state=status.state, reason=status.reason)

    participant.control.add_listener(on_control)
    participant.start()
    out.write(event="registered", member_id=member_id, workers=list(workers),
              revision=participant.member.revision, pid=os.getpid())
    plan = participant.control.plan
    if plan is not None:
        on_control(plan, participant.control.status)

    while not stop.wait(0.1):
        pass
    # A leave that takes long is a finding, not a detail: say when it began and how long
    # the whole of it took, so a test that gives up waiting can tell which member was slow.
    out.write(event="leaving")
    began = time.monotonic()
    coordinator = participant.coordinator
    leading = coordinator is not None and coordinator.leading.is_set()
    participant.leave()
    out.write(event="left", rounds_written=etcd.rounds_written, leading=leading,
              seconds=round(time.monotonic() - began, 3))
    out.close()
    etcd.close()
    return 0


def plan_from_record(record: dict) -> RoundPlan:
    return RoundPlan.from_json(json.dumps(record).encode())


if __name__ == "__main__":
    raise SystemExit(main())
