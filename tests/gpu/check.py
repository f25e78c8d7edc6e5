"""`make gpu-check`: the GPU path's checks that fit one GPU in 8 minutes, one line each.

    python -m tests.gpu.check [--only NAME,...] [--json PATH] [--total-s 480]

Runs the checks of the gpu review's section 4 (``../shared/reviews/gpu-2.md``) in their
order of value, each in a process of its own with its own time budget (a hang costs
that check's budget, never the run), and prints one line per check::

    PASS|FAIL|SKIP <name> [<finding>] <detail> (<seconds>s)

then writes a JSON with torch's, CUDA's, NCCL's and the driver's versions, the GPU, and
every check's figures. Without CUDA every CUDA check is SKIP with its reason and the run
exits 0; what runs on a CPU (the sharded check's script and harness over gloo) still
runs. The exit status is 1 if any check failed. A check still running past its budget
is killed with its children and is FAIL ("timed out"); a check whose budget no longer
fits in --total-s is SKIP.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

from .check_base import REPO, Check, Context, Outcome, Probe, skip_reason
from .checks_jobs import (commit_stall, cuda_snapshot_durable, default_backend_e2e, device_hang, sharded_world1,
                          sharded_world1_cpu)
from .checks_nccl import abort_in_setup, exit_join, stale_dump_key

TOTAL_S = 480.0  # one H100, 8 minutes (issue 31)

# Section 4's checks in its order of value (1, 3, 4, 5, then 2, 6, 7): when the total runs
# short, the last ones are the ones left out. The budgets add up to TOTAL_S.
CHECKS: tuple[Check, ...] = (
    Check("stale_dump_key", "G2", 45, stale_dump_key),
    Check("abort_in_setup", "G5b/F4", 60, abort_in_setup),
    Check("default_backend_e2e", "F2-F5/G3", 135, default_backend_e2e, needs=("cuda", "etcd")),
    Check("sharded_world1", "G6", 45, sharded_world1, needs=("cuda", "etcd")),
    Check("exit_join", "G2", 40, exit_join),
    Check("device_hang", "F12/G3", 60, device_hang, needs=("cuda", "etcd")),
    Check("cuda_snapshot_durable", "F6/F7/T1/T2", 60, cuda_snapshot_durable),
    Check("commit_stall", "G13", 35, commit_stall),
    # Only where there is no CUDA: the GPU run has the real one above. Outside TOTAL_S's sum
    # (it never runs with the others); 60 s on a loaded 2-core CI host, so room for more.
    Check("sharded_world1_cpu", "G6 (harness)", 180, sharded_world1_cpu, needs=("etcd", "no-cuda")),
)


def probe() -> Probe:
    import torch

    from elastic.rendezvous.embedded import find_etcd_binary
    from elastic.rendezvous.errors import RendezvousError

    try:
        find_etcd_binary()
        etcd = None
    except RendezvousError as exc:
        etcd = str(exc)
    cuda = torch.cuda.is_available()
    return Probe(cuda=cuda, device_count=torch.cuda.device_count() if cuda else 0, etcd=etcd)


def reason_to_skip(check: Check, found: Probe) -> Optional[str]:
    if "no-cuda" in check.needs and found.cuda:
        return "runs only without CUDA (the CUDA run has its own sharded check)"
    return skip_reason(check, found)


def versions() -> dict:
    """torch, CUDA, NCCL, the driver and the GPU (issue 31: record what ran)."""
    import torch

    found = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            found["driver"] = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            found["driver"] = f"nvidia-smi failed: {exc}"
    else:
        found["driver"] = None
    return found


def _registry(spec: str) -> Sequence[Check]:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr or "CHECKS")


def run_one(check: Check, workdir: Path, result: Path) -> int:
    """In the check's own process: run it, write its Outcome to ``result``."""
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        outcome = check.run(Context(workdir=workdir, budget_s=check.budget_s))
    except Exception as exc:  # noqa: BLE001 - a check that raises has failed; say where
        where = traceback.extract_tb(exc.__traceback__)[-1]
        outcome = Outcome(False, f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})")
    result.write_text(json.dumps({"ok": outcome.ok, "detail": outcome.detail, "figures": outcome.figures},
                                 default=str))
    return 0


def run_check(check: Check, registry: str, workdir: Path) -> dict:
    """Run ``check`` in a process of its own, bounded by its budget."""
    result = workdir / f"{check.name}.result.json"
    cmd = [sys.executable, "-m", "tests.gpu.check", "--registry", registry, "--run-one", check.name,
           "--workdir", str(workdir / check.name), "--result", str(result)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    started = time.monotonic()
    with open(workdir / f"{check.name}.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(check.budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the check and the children of its session
            proc.wait(30)
    seconds = round(time.monotonic() - started, 1)
    if result.exists():
        found = json.loads(result.read_text())
        return {"status": "PASS" if found["ok"] else "FAIL", "detail": found["detail"], "figures": found["figures"],
                "seconds": seconds}
    why = (f"timed out after {check.budget_s:g}s" if proc.returncode == -signal.SIGKILL
           else f"the check's process exited {proc.returncode} without a result")
    return {"status": "FAIL", "detail": f"{why} (log: {workdir / (check.name + '.log')})", "figures": {},
            "seconds": seconds}


def line(check: Check, entry: dict) -> str:
    seconds = f" ({entry['seconds']:g}s)" if entry.get("seconds") is not None else ""
    return f"{entry['status']} {check.name} [{check.finding}] {entry['detail']}{seconds}"


def run_all(checks: Sequence[Check], found: Probe, *, registry: str, workdir: Path, total_s: float,
            only: Optional[set] = None, out=print) -> list[dict]:
    started = time.monotonic()
    entries = []
    for check in checks:
        if only and check.name not in only:
            continue
        why = reason_to_skip(check, found)
        if why is None and time.monotonic() - started + check.budget_s > total_s:
            why = f"its {check.budget_s:g}s no longer fit in the run's {total_s:g}s"
        entry = {"status": "SKIP", "detail": why, "figures": {}, "seconds": None} if why else \
            run_check(check, registry, workdir)
        entry.update(name=check.name, finding=check.finding)
        out(line(check, entry))
        entries.append(entry)
    return entries


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated check names")
    parser.add_argument("--json", default="gpu-check.json", help="where to write versions and figures")
    parser.add_argument("--total-s", type=float, default=TOTAL_S)
    parser.add_argument("--workdir", default=None, help="the checks' files (default: a new temporary folder)")
    parser.add_argument("--registry", default="tests.gpu.check:CHECKS", help=argparse.SUPPRESS)
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    checks = _registry(args.registry)
    if args.run_one:
        return run_one(next(c for c in checks if c.name == args.run_one), Path(args.workdir), Path(args.result))
    names = {c.name for c in checks}
    only = set(args.only.split(",")) if args.only else None
    if only and only - names:
        print(f"gpu-check: no check named {', '.join(sorted(only - names))} (the checks: {', '.join(sorted(names))})",
              file=sys.stderr)
        return 2
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    found_versions, found = versions(), probe()
    print("gpu-check: " + ", ".join(f"{k} {v}" for k, v in found_versions.items()) + f"; files in {workdir}")
    started = time.monotonic()
    entries = run_all(checks, found, registry=args.registry, workdir=workdir, total_s=args.total_s, only=only)
    report = {"versions": found_versions, "probe": found.__dict__, "total_s": round(time.monotonic() - started, 1),
              "checks": entries}
    Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    failed = [e["name"] for e in entries if e["status"] == "FAIL"]
    print(f"gpu-check: {sum(e['status'] == 'PASS' for e in entries)} passed, {len(failed)} failed, "
          f"{sum(e['status'] == 'SKIP' for e in entries)} skipped in {report['total_s']:g}s; figures in {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
