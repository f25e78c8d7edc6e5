"""The GPU run's checks on one GPU in at most 8 minutes: preflight first, most information first.

    python -m tests.gpu.check --out DIR [--total-s 470] [--deadline EPOCH] [--only NAME,...]

Normally started by ``tests/gpu/run.sh`` (docs/gpus.md), which installs the GPU bundle
first. Runs the phases of ``PLAN`` in order (gpu review gpu-3, section 3C): the
preflight, which stops the run if the environment is broken; then each phase's checks,
at once where they are not timing-sensitive (16 cores), each in a process of its own
with its own budget. A check still running past its budget is killed with every process
it started (``check_base.sweep``) and is FAIL ("timed out"); a check whose budget no
longer fits before the deadline is SKIP, so the tail of the run is skipped, never cut
off mid-check. Without CUDA every CUDA check is SKIP with its reason and the CPU checks
run. One line per check on the console::

    PASS|FAIL|SKIP <name> [<finding>] <detail> (<seconds>s)

and in DIR (check_out.py): ``checks.jsonl`` (a line per check, written as it ends),
``summary.json``, ``logs.tgz``. Exit status 1 if any check failed, 3 if the preflight
found the environment broken.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Optional, Sequence

from .check_base import REPO, TAG, Check, Context, Outcome, Probe, skip_reason, sweep
from .check_out import Results

TOTAL_S = 470.0  # 8 minutes less the bundle's install and the start (tests/gpu/run.sh)
BROKEN = 3  # exit status: the preflight found the environment broken


def budget(check: Check) -> float:
    """A check's budget, times ``GPU_CHECK_BUDGET_SCALE`` (a loaded CPU host, by hand)."""
    return check.budget_s * float(os.environ.get("GPU_CHECK_BUDGET_SCALE", "1"))


def _lazy(module: str, name: str):
    """A check's function, imported in the check's own process only (the runner stays light)."""

    def run(ctx: Context) -> Outcome:
        return getattr(importlib.import_module(module, __package__), name)(ctx)

    run.__name__ = name
    return run


def _c(name, finding, budget_s, where, needs=("cuda",)) -> Check:
    module, _, function = where.partition(":")
    return Check(name, finding, budget_s, _lazy(module, function or name), needs=needs)


PREFLIGHT = _c("preflight", "N1/N3/env", 40, ".preflight:preflight", needs=())

# gpu-3 section 3C's order: what settles the most first. One tuple per phase: a phase's
# checks run at once (the timing-sensitive ones are alone in theirs). On one GPU the
# budgets of the phases add up to 455 s, under TOTAL_S.
PLAN: tuple[tuple[Check, ...], ...] = (
    (PREFLIGHT,),
    (_c("nccl_peer_loss", "G3'/G4/3C", 60, ".checks_peer", needs=("cuda", "two-ranks")),),
    (_c("default_backend_e2e", "F2-F5/G3", 110, ".checks_jobs", needs=("cuda", "etcd")),
     _c("stale_dump_key", "G2/N5", 45, ".checks_nccl"),
     _c("abort_in_setup", "G5b/F4/N6", 60, ".checks_nccl"),
     _c("exit_join", "G2", 40, ".checks_nccl")),
    (_c("three_agents_kill", "main claim", 100, ".checks_peer", needs=("cuda", "etcd")),
     # Where there is no CUDA: the same job on gloo and CPUs, what a CPU CI can run of it.
     _c("three_agents_kill_cpu", "main claim (CPU)", 40, ".checks_peer", needs=("etcd", "no-cuda"))),
    (_c("cuda_snapshot_durable", "F6/F7/T1/T2", 60, ".checks_jobs"),
     _c("capture_vs_watch", "N7/N3", 30, ".checks_peer"),
     _c("sharded_world1", "G6", 60, ".checks_jobs", needs=("cuda", "etcd"))),
    (_c("device_hang", "F12/G3/N13", 50, ".checks_jobs", needs=("cuda", "etcd")),),
    (_c("commit_stall", "G13", 35, ".checks_jobs"),),
    # Only when named (--only): the sharded check's script and harness on a CPU host, too
    # long for the CPU rehearsal's minute.
    (_c("sharded_world1_cpu", "G6 (harness)", 180, ".checks_jobs", needs=("etcd", "no-cuda", "named")),),
)
CHECKS: tuple[Check, ...] = tuple(c for phase in PLAN for c in phase)


def reason_to_skip(check: Check, found: Probe, only: Optional[set] = None) -> Optional[str]:
    if "no-cuda" in check.needs and found.cuda:
        return "runs only without CUDA (the CUDA run has its own)"
    if "named" in check.needs and not (only and check.name in only):
        return "runs only when named (--only)"
    return skip_reason(check, found)


def probe(facts: dict) -> Probe:
    """What the checks may count on, from the preflight's figures."""
    return Probe(cuda=bool(facts.get("cuda")), device_count=int(facts.get("device_count") or 0),
                 etcd=facts.get("etcd_missing"), two_ranks=facts.get("two_ranks_refused", "not probed"))


def _registry(spec: str) -> Sequence[Sequence[Check]]:
    module, _, attr = spec.partition(":")
    found = getattr(importlib.import_module(module), attr or "PLAN")
    return [phase if isinstance(phase, (tuple, list)) else (phase,) for phase in found]


def run_one(check: Check, workdir: Path, result: Path, facts: dict) -> int:
    """In the check's own process, in its own folder: run it, write its Outcome to ``result``."""
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)  # never the repository root (check_base's module docstring)
    try:
        outcome = check.run(Context(workdir=workdir, budget_s=budget(check), facts=facts))
    except Exception as exc:  # noqa: BLE001 - a check that raises has failed; say where
        where = traceback.extract_tb(exc.__traceback__)[-1]
        outcome = Outcome(False, f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})")
    result.write_text(json.dumps({"ok": outcome.ok, "detail": outcome.detail, "figures": outcome.figures},
                                 default=str))
    return 0


class Running:
    """One check's process, bounded by its budget."""

    def __init__(self, check: Check, registry: str, workdir: Path, facts_file: Path):
        self.check = check
        self.result = workdir / f"{check.name}.result.json"
        self.log_path = workdir / f"{check.name}.log"
        self.tag = f"{check.name}-{uuid.uuid4().hex[:8]}"
        (workdir / check.name).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "tests.gpu.check", "--registry", registry, "--run-one", check.name,
               "--workdir", str(workdir / check.name), "--result", str(self.result), "--facts", str(facts_file)]
        from .check_base import python_path

        env = dict(os.environ, PYTHONPATH=python_path(), PYTHONUNBUFFERED="1", **{TAG: self.tag})
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=workdir / check.name, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.timed_out = False

    def poll(self) -> bool:
        """True once the check has ended (killed with its processes past its budget)."""
        if self.proc.poll() is not None:
            return True
        if time.monotonic() - self.started > budget(self.check):
            self.timed_out = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the check and its process group
            except ProcessLookupError:
                pass
            self.proc.wait(30)
            return True
        return False

    def entry(self) -> dict:
        swept = sweep(self.tag)  # whatever it started in sessions of their own (agents, workers)
        seconds = round(time.monotonic() - self.started, 1)
        if self.result.exists() and not self.timed_out:
            found = json.loads(self.result.read_text())
            entry = {"status": "PASS" if found["ok"] else "FAIL", "detail": found["detail"],
                     "figures": found["figures"], "seconds": seconds}
        else:
            why = (f"timed out after {budget(self.check):g}s" if self.timed_out
                   else f"the check's process exited {self.proc.returncode} without a result")
            entry = {"status": "FAIL", "detail": f"{why} (its log: logs.tgz {self.log_path.name})", "figures": {},
                     "seconds": seconds}
        if swept:
            entry["figures"] = {**entry["figures"], "processes_killed_after": swept}
        return entry


def line(check: Check, entry: dict) -> str:
    seconds = f" ({entry['seconds']:g}s)" if entry.get("seconds") is not None else ""
    return f"{entry['status']} {check.name} [{check.finding}] {entry['detail']}{seconds}"


def run_plan(plan: Sequence[Sequence[Check]], results: Results, *, registry: str, workdir: Path, deadline: float,
             only: Optional[set] = None, out=print) -> list[dict]:
    facts_file = workdir / "facts.json"
    facts_file.write_text("{}")
    found = probe({})
    broken: Optional[str] = None
    entries = []

    def record(check: Check, entry: dict) -> None:
        entry = {"name": check.name, "finding": check.finding, **entry}
        results.record(entry)
        out(line(check, entry))
        entries.append(entry)

    for phase in plan:
        starting = []
        for check in phase:
            if only and check.name not in only and check is not phase_preflight(plan):
                continue
            why = f"not run: the preflight found the environment broken ({broken})" if broken else None
            if why is None and check is not phase_preflight(plan):
                why = reason_to_skip(check, found, only)
            left = deadline - time.time()
            if why is None and budget(check) > left:
                why = f"its {budget(check):g}s no longer fit in the run's total ({max(0.0, left):.0f}s left)"
            if why:
                record(check, {"status": "SKIP", "detail": why, "figures": {}, "seconds": None})
            else:
                starting.append(check)
        running = [Running(check, registry, workdir, facts_file) for check in starting]
        while running:
            for run in [r for r in running if r.poll()]:
                running.remove(run)
                entry = run.entry()
                record(run.check, entry)
                if run.check is phase_preflight(plan):
                    facts = entry["figures"]
                    facts_file.write_text(json.dumps(facts, default=str))
                    found = probe(facts)
                    results.write_summary(preflight=facts)
                    if entry["status"] != "PASS":
                        broken = entry["detail"][:200]
            time.sleep(0.1)
        if starting:
            results.pack_logs()
    return entries


def phase_preflight(plan: Sequence[Sequence[Check]]) -> Optional[Check]:
    """The plan's preflight: the first phase's only check, if it is named so."""
    first = plan[0] if plan else ()
    return first[0] if len(first) == 1 and first[0].name == "preflight" else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the results' folder (at most 4 files: check_out.py)")
    parser.add_argument("--only", default=None, help="comma-separated check names (the preflight always runs)")
    parser.add_argument("--total-s", type=float, default=TOTAL_S)
    parser.add_argument("--deadline", type=float, default=None,
                        help="the run's end as a Unix time (run.sh: its start plus --total-s)")
    parser.add_argument("--workdir", default=None, help="the checks' files (default: a new temporary folder)")
    parser.add_argument("--registry", default="tests.gpu.check:PLAN", help=argparse.SUPPRESS)
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--facts", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    plan = _registry(args.registry)
    checks = [c for phase in plan for c in phase]
    if args.run_one:
        facts = json.loads(Path(args.facts).read_text()) if args.facts else {}
        return run_one(next(c for c in checks if c.name == args.run_one), Path(args.workdir), Path(args.result), facts)
    if not args.out:
        print("gpu-check: --out DIR is required (where the results go)", file=sys.stderr)
        return 2
    names = {c.name for c in checks}
    only = set(args.only.split(",")) if args.only else None
    if only and only - names:
        print(f"gpu-check: no check named {', '.join(sorted(only - names))} (the checks: {', '.join(sorted(names))})",
              file=sys.stderr)
        return 2
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    deadline = args.deadline if args.deadline is not None else time.time() + args.total_s
    results = Results(Path(args.out), workdir, {"python": sys.version.split()[0], "executable": sys.executable,
                                                "deadline_in_s": round(deadline - time.time(), 1)})
    print(f"gpu-check: {len(checks)} checks, {deadline - time.time():.0f}s left; results in {args.out}, "
          f"work files in {workdir}", flush=True)
    started = time.monotonic()
    entries = run_plan(plan, results, registry=args.registry, workdir=workdir, deadline=deadline, only=only)
    results.write_summary(total_s=round(time.monotonic() - started, 1))
    packed = results.pack_logs()
    failed = [e["name"] for e in entries if e["status"] == "FAIL"]
    print(f"gpu-check: {sum(e['status'] == 'PASS' for e in entries)} passed, {len(failed)} failed, "
          f"{sum(e['status'] == 'SKIP' for e in entries)} skipped in {time.monotonic() - started:.0f}s; "
          f"{packed['files']} log files in logs.tgz ({packed['bytes'] / 1e6:.1f} MB)", flush=True)
    if any(e["name"] == "preflight" and e["status"] != "PASS" for e in entries):
        return BROKEN
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
