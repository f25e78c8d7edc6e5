"""How long an agent takes to start a replacement worker once the round that wants it arrives.

    python -m benchmarks.worker_start [--kills 4] [--before-tree DIR --before-run DIR/venv/bin/elastic-run]
                                      [--reps 1] [--json PATH]

Two agents (one worker each) train the benchmark workload against an embedded etcd. The
worker of the agent that does not hold rank 0 is SIGKILLed, ``--kills`` times, once the
ring trains with its replacement again. For each replacement, the figure is the agent's
own: from its ``round_started`` event (it took the plan that wants the new worker) to its
``worker_started`` event (the process is spawned), both in the same call of the agent's
loop. Before issue 36 that call waited, polling etcd, for the torchrun-style store that
rank 0's agent publishes for every round (``plain_store.py``), although an elastic worker
never uses it; now an agent whose workers are known to be elastic does not wait.

``--before-tree``/``--before-run`` run the same job with another tree (a checkout of the
tree before the change, ``git archive``, installed in a venv of its own with ``pip install
-e``; its workers run from that tree too) in the same run, alternating, so both see the
same load. The first round's start is printed too: the agent cannot
know yet that its script is elastic, so both trees wait for the store there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from elastic.rendezvous import EmbeddedEtcd

from .harness import BIN, REPO, WORKLOAD_MODULE, Job, benchmark_env, wait_for, write_json_report


def _events(log_dir: Path) -> list[dict]:
    path = log_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_job(elastic_run: str, tree: Path, label: str, endpoint: str, kills: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"bench-start-{label}-"))
    logs = work / "logs"
    job_id = f"start-{label}-{work.name[-6:]}"

    def agent(host: str) -> list[str]:
        return [elastic_run, "--rdzv-endpoint", endpoint, "--job-id", job_id, "--host-id", host,
                "--host-addr", "127.0.0.1", "--nproc-per-node", "1", "--min-np", "1", "--max-np", "2",
                "--max-restarts", str(kills), "--log-dir", str(logs), "-m", WORKLOAD_MODULE, "--mode", "elastic",
                "--steps", "1000000", "--commit-every", "1"]

    env = benchmark_env(PYTHONPATH=str(tree))  # the workload module from the tree under test, and its elastic
    load = os.getloadavg()[0]
    waits, first = [], None
    with Job(agent("host-a"), env, work / "a.log", cwd=tree), Job(agent("host-b"), env, work / "b.log", cwd=tree):
        for kill in range(kills + 1):
            # A ring of two that trains: a steps record of a world of two after the newest start.
            def trained_two():
                events = _events(logs)
                started = [e for e in events if e["event"] == "worker_started"]
                return events if started and any(e["event"] == "steps" and e.get("world_size") == 2
                                                 and e["time"] > started[-1]["time"] for e in events) else None
            events = wait_for(trained_two, 300)
            if not events:
                return {"tree": label, "error": f"no ring of two trained (kill {kill})", "work": str(work)}
            started = [e for e in events if e["event"] == "worker_started"]
            if kill == 0:  # the first round's host without rank 0: it waits for the store in both trees
                other = next(e for e in started if e.get("rank") != 0)
                took = next(e for e in events if e["event"] == "round_started" and e["host"] == other["host"]
                            and e["round"] == other["round"])
                first = other["time"] - took["time"]
            if kill == kills:
                break
            # The victim: the newest worker of the host that does not hold rank 0.
            victim = next(e for e in reversed(started) if e.get("rank") != 0)
            os.kill(victim["pid"], signal.SIGKILL)
            replaced = wait_for(lambda: [e for e in _events(logs) if e["event"] == "worker_started"][len(started):],
                                120)
            if not replaced:
                return {"tree": label, "error": "no replacement started", "work": str(work)}
            spawn = replaced[0]
            took = [e for e in _events(logs) if e["event"] == "round_started" and e["host"] == spawn["host"]
                    and e["round"] == spawn["round"]]
            waits.append(spawn["time"] - took[-1]["time"])
    return {"tree": label, "replacement_start_s": waits, "first_round_start_s": first, "loadavg_1min": load,
            "work": str(work)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--reps", type=int, default=1, help="jobs per tree")
    parser.add_argument("--before-tree", help="the tree to compare with (its root)")
    parser.add_argument("--before-run", help="that tree's elastic-run (in a venv where it is installed)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    trees = [("this", str(BIN / "elastic-run"), REPO)]
    if args.before_tree:
        trees.append(("before", args.before_run, Path(args.before_tree)))
    results = []
    with EmbeddedEtcd() as etcd:
        for rep in range(args.reps):
            for label, elastic_run, tree in (trees if rep % 2 == 0 else trees[::-1]):
                result = one_job(elastic_run, tree, label, etcd.endpoint, args.kills)
                results.append(result)
                print(f"{label} rep {rep + 1}: " + (result.get("error") or
                      f"replacement starts {', '.join(f'{w * 1000:.0f}' for w in result['replacement_start_s'])} ms;"
                      f" first round's other host {result['first_round_start_s'] * 1000:.0f} ms"
                      f" (load {result['loadavg_1min']:.1f})"), flush=True)
    print(f"\n{'tree':<8} {'starts':>6} {'median':>9} {'max':>9} {'first round':>12}")
    summary = {}
    for label, _, _ in trees:
        mine = [r for r in results if r["tree"] == label and "error" not in r]
        waits = [w for r in mine for w in r["replacement_start_s"]]
        if not waits:
            print(f"{label:<8} none measured")
            continue
        firsts = [r["first_round_start_s"] for r in mine]
        summary[label] = {"starts": len(waits), "median_s": statistics.median(waits), "max_s": max(waits),
                          "first_round_median_s": statistics.median(firsts)}
        print(f"{label:<8} {len(waits):>6} {summary[label]['median_s'] * 1000:>7.1f}ms {max(waits) * 1000:>7.1f}ms "
              f"{summary[label]['first_round_median_s'] * 1000:>10.1f}ms")
    if args.json:
        write_json_report(args.json, "worker_start", summary=summary, runs=results, created_at=time.time())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
