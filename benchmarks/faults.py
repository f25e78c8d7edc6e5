"""Fault benchmark: per fault kind, the time from the fault to the next step of the re-formed ring.

    python -m benchmarks.faults [--reps 3] [--only crash,hang,...] [--launchers elastic,torchrun,...]
                                [--quick] [--json benchmarks/results/faults.json]

Kinds (benchmarks/fault_kinds.py has the topologies):
  crash              SIGKILL of a worker                              2 agents x 2 workers
  hang               SIGSTOP of a worker (elastic-run's watchdog evicts it)
  partition-host     a plain host's link cut (no rank 0, no coordinator)  3 namespaced hosts x 2
  partition-rank0    the link of rank 0's and the coordinator's host cut
  host-kill-rank0    agent and workers of rank 0's (and the coordinator's) host SIGKILLed
  etcd-leader-kill   SIGKILL of the leader of a 3-member etcd cluster
  etcd-outage        the whole etcd SIGKILLed, restarted after --outage s (30)
  etcd-freeze        the whole etcd SIGSTOPped, SIGCONT after --outage s

For crash, hang and partitions: fault -> first step a surviving worker completes
afterwards, and the steps re-run (last step before the fault minus the step the job
resumed from). For etcd faults: the longest pause between two steps of any worker
from the fault to --settle s after etcd is back, and whether the ring re-formed.
Median over --reps. torchrun (c10d rendezvous, with and without
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) runs the kinds it can run at all (it has no
etcd) with a bounded wait of --torchrun-cap s; it has no hang detection, so a rep
without recovery is "no recovery within the cap" (the gloo collective timeout is
30 min), and the remaining reps of that row are skipped.
Partition rows need root and network namespaces; without them they are skipped,
saying why.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from . import harness
from .fault_kinds import KINDS, LAUNCHERS, Cluster, inject, longest_pause, next_step, reformations

DEFAULT_JSON = harness.REPO / "benchmarks" / "results" / "faults.json"
GLOO_COLLECTIVE_TIMEOUT = "30 min"  # torch's default for gloo process groups


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="reps per kind and launcher (median of these)")
    parser.add_argument("--only", type=_names(KINDS), default=list(KINDS), help="comma-separated kinds")
    parser.add_argument("--launchers", type=_names(LAUNCHERS), default=list(LAUNCHERS),
                        help="comma-separated: elastic, torchrun, torchrun-noshare")
    parser.add_argument("--quick", action="store_true",
                        help="1 rep, 10 s outages, 30 s torchrun cap, no rejoin wait: proves every row runs")
    parser.add_argument("--outage", type=float, default=30.0, help="seconds etcd is down or frozen")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds watched after etcd is back")
    parser.add_argument("--recover-timeout", type=float, default=60.0, help="elastic-run: bounded wait per rep")
    parser.add_argument("--torchrun-cap", type=float, default=60.0, help="torchrun: bounded wait per rep")
    parser.add_argument("--rejoin-timeout", type=float, default=60.0,
                        help="partitions: wait after the heal for the cut host to step again (0: skip)")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--start-timeout", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.outage, args.settle, args.torchrun_cap, args.rejoin_timeout = 1, 10.0, 8.0, 30.0, 0.0
        args.warmup_steps = 10
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def _names(known) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or 'empty list'}; "
                                             f"choose from {', '.join(known)}")
        return names
    return parse


def netns_unavailable() -> str | None:
    """Why namespaced hosts cannot be made here (None if they can)."""
    try:
        from tests.fakes import netns
    except ImportError as exc:  # the fixture module imports pytest
        return f"tests.fakes.netns cannot be imported: {exc}"
    # Whatever this benchmark creates is named after it, as every user of the machine's
    # namespaces names theirs, so that one run never takes another's for a leftover.
    netns.PREFIX = "bench-"
    try:
        netns.check_available()
    except netns.NetnsUnavailable as exc:
        return str(exc)
    return None


def hosts_factory(count: int):
    from tests.fakes import netns

    return netns.Hosts(count)


def one_rep(kind_name: str, launcher: str, args, rng: random.Random) -> dict:
    kind = KINDS[kind_name]
    with tempfile.TemporaryDirectory(prefix=f"bench-faults-{kind_name}-") as tmp:
        cluster = Cluster(kind, launcher, Path(tmp), hosts_factory)
        try:
            return run_fault(cluster, args, rng)
        except RuntimeError as exc:  # an agent or etcd that did not come up
            return {"error": str(exc)}
        finally:
            tails = {f.name: f.read_text(errors="replace")[-1500:] for f in Path(tmp).glob("agent*.log")}
            cluster.close()
            _last_logs.clear()
            _last_logs.update(tails)


_last_logs: dict[str, str] = {}  # agent log tails of the last rep, shown when it failed


def run_fault(cluster: Cluster, args, rng: random.Random) -> dict:
    started = time.monotonic()
    cluster.start(args.start_timeout)
    if not harness.wait_for(lambda: cluster.warmed_up(args.warmup_steps) or not cluster.running(),
                            args.start_timeout) or not cluster.running():
        return {"error": "the job did not start (or an agent exited) before the warm-up"}
    target = max(len(w.steps) for w in cluster.workers()) + rng.randint(0, 20)
    harness.wait_for(lambda: max(len(w.steps) for w in cluster.workers()) >= target, 30)
    result = {"startup_s": time.monotonic() - started}
    fault = inject(cluster, rng, args.outage)
    result.update(fault.info)
    if cluster.kind.measure == "pause":
        time.sleep(args.settle)  # the window watched after etcd is back: its length is the measurement's
        result.update(longest_pause(cluster.workers(), fault, args.settle))
        result["reformations"] = reformations(cluster.log_dir / "events.jsonl", fault.time)
        result["agents_running"] = cluster.running()
        return result
    cap = args.recover_timeout if cluster.launcher == "elastic" else args.torchrun_cap
    harness.wait_for(lambda: next_step(cluster.workers(), fault)["recovered"], cap, interval=0.1)
    result.update(next_step(cluster.workers(), fault))
    result["cap_s"] = cap
    if fault.info.get("cut_host") is not None:
        healed = time.time()
        fault.undo()
        if result["recovered"] and cluster.launcher == "elastic" and args.rejoin_timeout > 0:
            result["heal_to_rejoin_s"] = rejoin_time(cluster, fault.info["cut_host"], healed, args.rejoin_timeout)
    return result


def rejoin_time(cluster: Cluster, host: int, healed: float, timeout: float) -> float | None:
    """Heal -> first step after it completed by a worker of the cut host (a new or an old one)."""
    def stepped():
        pids = harness.descendants(cluster.jobs[host].proc.pid)
        times = [s[1] for w in cluster.workers() if w.pid in pids for s in w.steps if s[1] > healed]
        return min(times) - healed if times else None
    return harness.wait_for(stepped, timeout, interval=0.2)


def summarize(kind: str, launcher: str, reps: list[dict], skipped: int) -> dict:
    summary = {"kind": kind, "launcher": launcher, "reps": len(reps), "skipped_reps": skipped,
               "errors": sum(1 for r in reps if r.get("error"))}
    good = [r for r in reps if not r.get("error")]
    if KINDS[kind].measure == "pause":
        pauses = [r["longest_pause_s"] for r in good if r.get("longest_pause_s") is not None]
        summary.update(median_pause_s=_median(pauses), max_pause_s=max(pauses, default=None),
                       reformed=sum(1 for r in good if r["reformations"]),
                       steps_rerun=sum(r["steps_rerun"] for r in good),
                       median_step_s=_median([r["median_step_s"] for r in good]))
    else:
        times = [r["fault_to_next_step_s"] for r in good if r.get("recovered")]
        summary.update(recovered=len(times), median_s=_median(times), max_s=max(times, default=None),
                       median_steps_rerun=_median([r["steps_rerun"] for r in good if r.get("recovered")]),
                       cap_s=max((r.get("cap_s", 0) for r in good), default=None),
                       median_rejoin_s=_median([r["heal_to_rejoin_s"] for r in good if r.get("heal_to_rejoin_s")]))
    return summary


def _median(values):
    return statistics.median(values) if values else None


def print_table(summaries: list[dict], skipped_kinds: dict[str, str]) -> None:
    print(f"\n{'kind':17} {'launcher':17} {'ok':>5} {'median':>9} {'max':>9} {'re-run':>7}  notes")
    for s in summaries:
        done = s["reps"] - s["errors"]
        if "median_pause_s" in s:
            ok = f"{done}/{s['reps']}"
            notes = f"longest pause between steps; re-formed in {s['reformed']}/{done}, median step " \
                    f"{harness.fmt(s['median_step_s'])}"
            row = (harness.fmt(s["median_pause_s"]), harness.fmt(s["max_pause_s"]), str(s["steps_rerun"]))
        else:
            ok = f"{s['recovered']}/{s['reps']}"
            notes = "" if s["recovered"] else f"no recovery within {s['cap_s']:g} s"
            if not s["recovered"] and s["launcher"] != "elastic" and s["kind"] != "crash":
                notes += f" (> gloo collective timeout, {GLOO_COLLECTIVE_TIMEOUT})"
            if s.get("median_rejoin_s") is not None:
                notes += f"heal -> cut host steps again {harness.fmt(s['median_rejoin_s'])}"
            rerun = "-" if s["median_steps_rerun"] is None else f"{s['median_steps_rerun']:g}"
            row = (harness.fmt(s["median_s"]), harness.fmt(s["max_s"]), rerun)
        if s["skipped_reps"]:
            notes += f"; {s['skipped_reps']} more reps skipped"
        if s["errors"]:
            notes += f"; {s['errors']} reps failed to start"
        print(f"{s['kind']:17} {s['launcher']:17} {ok:>5} {row[0]:>9} {row[1]:>9} {row[2]:>7}  {notes}")
    for kind, why in skipped_kinds.items():
        print(f"{kind:17} {'-':17} {'-':>5} {'-':>9} {'-':>9} {'-':>7}  skipped: {why}")


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    skipped_kinds: dict[str, str] = {}
    if any(KINDS[k].netns for k in args.only) and (why := netns_unavailable()):
        skipped_kinds = {k: why for k in args.only if KINDS[k].netns}
    results: dict[str, dict[str, list[dict]]] = {}
    summaries = []
    for kind in args.only:
        if kind in skipped_kinds:
            continue
        for launcher in args.launchers:
            if launcher != "elastic" and not KINDS[kind].torchrun:
                continue
            reps = results.setdefault(kind, {}).setdefault(launcher, [])
            for rep in range(args.reps):
                started = time.monotonic()
                result = one_rep(kind, launcher, args, rng)
                if result.get("error"):
                    result["agent_logs"] = dict(_last_logs)
                reps.append(result)
                print(f"{kind} {launcher} rep {rep + 1}/{args.reps}: {describe(result)} "
                      f"(rep took {time.monotonic() - started:.0f}s)", flush=True)
                # A launcher that did not recover within the cap would only spend the cap again.
                if launcher != "elastic" and result.get("recovered") is False:
                    break
            summaries.append(summarize(kind, launcher, reps, args.reps - len(reps)))
    print_table(summaries, skipped_kinds)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args),
                                               "summaries": summaries, "skipped_kinds": skipped_kinds,
                                               "reps": results}, indent=2))
        print(f"wrote {args.json}")
    return 0


def describe(result: dict) -> str:
    if result.get("error"):
        tails = " | ".join(f"{name}: ...{text[-300:]!r}" for name, text in result.get("agent_logs", {}).items())
        return f"{result['error']} [{tails}]"
    if "longest_pause_s" in result:
        return (f"longest pause {harness.fmt(result['longest_pause_s'])}, {result['reformations']} re-formations, "
                f"{result['steps_rerun']} steps re-run, {result}")
    if not result.get("recovered"):
        return f"no step within {result['cap_s']:g}s after the fault ({result})"
    return (f"next step {harness.fmt(result['fault_to_next_step_s'])} after the fault, "
            f"{result['steps_rerun']} steps re-run, {result}")


if __name__ == "__main__":
    raise SystemExit(main())
