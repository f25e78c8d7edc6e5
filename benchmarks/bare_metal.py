"""Bare metal, no etcd of the user's: from a host's loss to the survivors' next step, the
endpoint's host lost against another host lost.

    python -m benchmarks.bare_metal [--reps 1] [--hosts 3] [--ttl 4] [--json PATH] [--only endpoint|other]
        [--keep DIR]

Per rep and case: N namespaced hosts (tests/fakes/netns.py; root and `ip` needed) run
torchrun's multi-node command (``--nnodes=2:N --nproc-per-node=1 --rdzv-backend=c10d
--rdzv-endpoint=<host 0>:29400``) of tests/fakes/train_job.py; host 0 serves the
rendezvous, which has three members once three hosts are in. When the ring of N trains
and the etcd has its three members, every process of the victim (agent, worker, and its
etcd member: host 0's is the endpoint's) gets SIGKILL; the figure is the time to the
first step the survivors record in their world of N-1. Goal: the endpoint's host no
slower than another (within noise), both within --rdzv-ttl + 2 s. ``--keep DIR`` keeps each
rep's hosts' logs (agents' output, workers' logs, steps) under DIR/rep<N>-host<victim>.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from elastic.rendezvous import Etcd, EtcdConfig
from elastic.rendezvous.cluster_rpc import member_list
from elastic.rendezvous.job_secret import JobSecret, new_secret, write_secret_file
from tests.fakes import netns
from tests.fakes.jobs import TRAIN_JOB, read_jsonl
from tests.fakes.waiting import poll

PORT = 29400


def _three_members(endpoint: str, client: dict) -> bool:
    try:
        with Etcd(EtcdConfig.from_string(endpoint, retry_deadline=2.0, call_timeout=1.0, **client)) as etcd:
            return len([m for m in member_list(etcd) if m.started and not m.is_learner]) == 3
    except Exception:  # noqa: BLE001 - not up yet
        return False


def one_rep(tmp: Path, count: int, ttl: float, victim: int) -> dict:
    hosts = netns.Hosts(count, etcd=False)
    try:
        out, stop = tmp / "out", tmp / "stop"
        endpoint = f"{hosts[0].addr}:{PORT}"
        secret = write_secret_file(str(tmp / "job.secret"), new_secret())  # secured, as every job off loopback
        js = JobSecret(open(secret).read().strip())
        files = js.client_files(str(tmp))
        client = {"ca_cert": files.ca_cert, "user": files.user, "password": js.password}
        for host in hosts:
            host.job(tmp / host.name, [
                f"--nnodes=2:{count}", "--nproc-per-node=1", "--rdzv-id=bench", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}", "--job-secret-file", secret, "--host-id", host.name, "--rdzv-ttl", str(ttl),
                "--log-dir", str(tmp / host.name / "logs"), str(TRAIN_JOB), "--out", str(out),
                "--steps", "100000", "--step-delay", "0.05", "--stop-file", str(stop)], name="agent")
        steps = lambda: read_jsonl(out / "steps.jsonl") if (out / "steps.jsonl").exists() else []  # noqa: E731
        if not poll(lambda: len([s for s in steps() if s["world"] == count]) >= 10 * count, 240, 0.2):
            raise RuntimeError(f"the {count}-host ring never trained: see {tmp}")
        if not poll(lambda: _three_members(endpoint, client), 60, 0.2):
            raise RuntimeError(f"the etcd never had three members: see {tmp}")
        killed_at = time.time()
        hosts[victim]._kill_processes()
        after = poll(lambda: [s for s in steps() if s["t"] > killed_at and s["world"] == count - 1], ttl + 60, 0.05)
        if not after:
            raise RuntimeError(f"the survivors never stepped: see {tmp}")
        stop.touch()
        return {"victim": victim, "endpoint_host": victim == 0, "killed_at": killed_at,
                "loss_to_next_step_s": min(s["t"] for s in after) - killed_at}
    finally:
        hosts.destroy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--ttl", type=float, default=4.0)
    p.add_argument("--json", default="benchmarks/results/bare_metal.json")
    p.add_argument("--only", choices=("endpoint", "other"), help="lose only this host (both by default)")
    p.add_argument("--keep", help="copy each rep's logs under this directory")
    args = p.parse_args()
    victims = {"endpoint": (0,), "other": (args.hosts - 1,)}.get(args.only, (0, args.hosts - 1))
    netns.check_available()
    netns.sweep_leftovers()
    rows = []
    for rep in range(args.reps):
        for victim in victims:  # alternate, so the load drifts over both alike
            with tempfile.TemporaryDirectory(prefix="bench-bare-metal-") as tmp:
                try:
                    row = one_rep(Path(tmp), args.hosts, args.ttl, victim)
                finally:
                    if args.keep:
                        shutil.copytree(tmp, Path(args.keep) / f"rep{rep}-host{victim}", dirs_exist_ok=True,
                                        ignore=shutil.ignore_patterns("*.secret", "*password*", "*.pt"))
            rows.append({"rep": rep, **row})
            print(f"rep {rep}: host {victim} ({'the endpoint' if victim == 0 else 'another'}) lost -> "
                  f"next step {row['loss_to_next_step_s']:.2f}s", flush=True)
    summary = {}
    for endpoint in (True, False):
        values = [r["loss_to_next_step_s"] for r in rows if r["endpoint_host"] == endpoint]
        if not values:
            continue
        summary["endpoint_host" if endpoint else "other_host"] = {
            "median_s": statistics.median(values), "min_s": min(values), "max_s": max(values), "n": len(values)}
    print(f"\n| lost host ({args.hosts} hosts, --rdzv-ttl {args.ttl:g}) | median | min | max | n |\n|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name.replace('_', ' ')} | {s['median_s']:.2f} s | {s['min_s']:.2f} s | {s['max_s']:.2f} s | {s['n']} |")
    Path(args.json).write_text(json.dumps({"hosts": args.hosts, "ttl": args.ttl, "rows": rows, "summary": summary},
                                          indent=1) + "\n")


if __name__ == "__main__":
    main()
