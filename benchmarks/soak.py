"""Soak benchmark: 1,000 mixed faults in a row on four namespaced hosts, every one recovered.

    sudo python -m benchmarks.soak [--faults 1000] [--seed N] [--json benchmarks/results/soak.json]

Worker kills, SIGSTOP hangs and short pauses, agents killed and joined again, hosts cut
off (link down) and partitioned from their peers, the etcd leader and a follower killed
and restarted (tests/chaos/soak_bed.py has the list and the checks). Per kind: how many,
the median and the longest time from the fault to the next step of any worker (a pause:
from its end), how many took over 2 s, and the longest wait for the whole 4-worker ring.
Then: the final parameters against a single-process float64 run of as many steps, the
steps re-run, and leaks (processes of the run, descriptors and threads of the agents that
lived throughout, the job's etcd keys, the agents' private directories).

Faults that may last longer than 2 s by their nature are marked: a freeze is declared hung
after the hang bound (1 s for a stopped worker, or 3x its slowest step), a host cut off or partitioned, or an agent killed, is noticed by its
lease's TTL (6 s here) or the peer probe. The CI test (tests/chaos/test_soak.py) is the
same run with 100 faults. Needs root and network namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from elastic.rendezvous.embedded import EmbeddedEtcdCluster
from tests.chaos.soak_bed import HOSTS, run_soak
from tests.fakes.netns import Hosts, NetnsUnavailable, check_available, sweep_leftovers


def table(result: dict) -> str:
    lines = [f"{'kind':<12} {'count':>5} {'median s':>9} {'max s':>7} {'over 2 s':>8} {'ring of 4 max s':>15}  note",
             "-" * 78]
    for kind, row in result["by_kind"].items():
        note = "lasts longer than 2 s by nature" if row["lasts_longer"] else ""
        lines.append(f"{kind:<12} {row['count']:>5} {row['median_s']:>9.2f} {row['max_s']:>7.2f} {row['over_2s']:>8} "
                     f"{row['full_max_s']:>15.2f}  {note}")
    lines.append("-" * 78)
    lines.append(f"{result['faults']} faults, {result['steps']} steps, {result['rerun']} re-run for "
                 f"{result['failures']} failures; final parameters vs one process: max |diff| "
                 f"{result['max_abs_diff']:.1e} (bit-equal: {result['float64_equal']})")
    lines.append(f"leaks: {result['leaks']}")
    lines.append(f"{result['elapsed_s']:.0f} s (start-up {result['startup_s']:.0f} s, faults {result['faults_s']:.0f} s) "
                 f"+ reference {result['reference_s']:.0f} s; load average at the end {result['load_average']:.1f}")
    lines.append("problems: " + ("none" if not result["problems"] else "; ".join(result["problems"])))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=1000)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="write the figures (and every fault) there")
    p.add_argument("--quiet", action="store_true", help="no line per fault")
    args = p.parse_args(argv)
    try:
        check_available()
    except NetnsUnavailable as exc:
        print(f"soak: cannot run: {exc}")
        return 2
    sweep_leftovers()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        hosts = Hosts(HOSTS, etcd=False)
        try:
            cluster = EmbeddedEtcdCluster(3, host=hosts.bridge_addr, log_dir=tmp).start()
            try:
                result = run_soak(hosts, cluster, Path(tmp), args.faults, seed,
                                  (lambda line: None) if args.quiet else (lambda line: print(line, flush=True)))
            finally:
                cluster.stop()
        finally:
            hosts.destroy()
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if not result["problems"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
