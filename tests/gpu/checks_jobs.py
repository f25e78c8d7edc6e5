"""The GPU run's checks through the real launcher and the GPU tests: the default
backend end to end with ring breaks and a device-stalled collective, a sharded model at
world 1, the device-hang positive control, the CUDA snapshot and durable tests, and the
commit-stall benchmark (gpu review section 4 checks 4-7; G3, G6, G13)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from tests.fakes.jobs import Job, read_jsonl

from .check_base import REPO, Context, Outcome, child_env, run_children

SHARDED_SCRIPT = REPO / "tests" / "gpu" / "sharded_world1.py"
WORLD1 = ["--np", "1", "--min-np", "1", "--max-np", "1"]
E2E_STEPS = 90


def _job(ctx: Context, name: str, launch: list, script_args: list, script: Path = None) -> Job:
    out, logs = ctx.workdir / name / "out", ctx.workdir / name / "logs"
    (ctx.workdir / name).mkdir(parents=True)
    args = Job.train_args(out, logs, launch, script_args)
    if script is not None:
        args = [*launch, "--log-dir", str(logs), str(script), "--out", str(out), *script_args]
    env = child_env({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    return Job(ctx.workdir / name, args, name=name, env={k: v for k, v in env.items() if k != "PYTHONPATH"})


def _wait_all(ctx: Context, jobs: dict) -> dict:
    """Each job's exit status, None for one still running at the check's bound (killed)."""
    codes = {}
    for name, job in jobs.items():
        try:
            codes[name] = job.proc.wait(ctx.left())
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: past the bound
            job.kill()
            codes[name] = None
    return codes


def _events(job: Job, event: str) -> list:
    try:
        return [e for e in job.events() if e["event"] == event]
    except FileNotFoundError:
        return []


def _final(job: Job):
    import torch  # here, not at the top: every check's process imports this module (check.py)

    finals = sorted(job.out.glob("final-*.pt"))
    return torch.load(finals[-1], weights_only=True) if finals else None


def default_backend_e2e(ctx: Context) -> Outcome:
    """``--backend auto`` on a GPU host (cpu:gloo,cuda:nccl) trains through a ring broken
    every third step exactly like an unbroken run, and re-forms after a collective that
    the device stalled past --collective-timeout (the watchdog's TIMEOUT, RingBroken)."""
    auto = [*WORLD1, "--backend", "auto", "--max-resets", "500"]
    train = ["--device", "cuda", "--steps", str(E2E_STEPS)]
    jobs = {"clean": _job(ctx, "clean", auto, train),
            "broken": _job(ctx, "broken", auto, [*train, "--break-ring-every", "3"]),
            # --hang-timeout: a fixed bound well past the 6 s stall (the review ran it so; before the
            # G3 fix the derived device bound, 5 s, killed the worker first).
            "stalled": _job(ctx, "stalled", [*auto, "--collective-timeout", "3", "--hang-timeout", "30"],
                            [*train, "--device-stall-step", "5", "--device-stall-s", "6"])}
    codes = _wait_all(ctx, jobs)
    reforms = {name: _events(job, "reform_done") for name, job in jobs.items()}
    figures = {"rc": codes, "reforms": {name: len(r) for name, r in reforms.items()},
               "stalled_reasons": [r.get("reason") for r in reforms["stalled"]][:3],
               "hangs": {name: len(_events(job, "hang_detected")) for name, job in jobs.items()}}
    problems = [f"{name} exited {rc}: {jobs[name].text()[-300:]!r}" for name, rc in codes.items() if rc != 0]
    if not problems:
        clean, broken = _final(jobs["clean"]), _final(jobs["broken"])
        if clean is None or broken is None or any(not v.equal(broken[k]) for k, v in clean.items()):
            problems.append("the broken run's final parameters differ from the clean run's")
        if len(reforms["broken"]) < E2E_STEPS // 3 - 2 or not all(r["failed"] for r in reforms["broken"]):
            problems.append(f"{len(reforms['broken'])} re-formations for {E2E_STEPS // 3} breaks")
        if not reforms["stalled"] or figures["hangs"]["stalled"]:
            problems.append("the device-stalled collective did not end in a re-formation, or was judged a hang")
    if problems:
        return Outcome(False, "; ".join(problems)[:600], figures)
    return Outcome(True, f"{len(reforms['broken'])} re-formations, finals equal; stalled collective re-formed "
                   f"({figures['stalled_reasons'][:1]})", figures)


def _sharded(ctx: Context, backend: str, expect: str) -> Outcome:
    job = _job(ctx, f"sharded-{expect}", [*WORLD1, "--backend", backend, "--max-resets", "5"],
               ["--expect", expect], script=SHARDED_SCRIPT)
    rc = _wait_all(ctx, {"sharded": job})["sharded"]
    result = job.out / "result.json"
    figures = {"rc": rc, **(json.loads(result.read_text()) if result.exists() else {})}
    if rc != 0 or not result.exists():
        said = re.findall(r"sharded_world1: .*|\w*Error: .*", job.text())
        return Outcome(False, f"exited {rc}: {(said or [job.text()[-300:]])[-1]}"[:500], figures)
    ok = figures["param_device"].startswith(expect) and len(figures["rounds"]) >= 2
    return Outcome(ok, f"model on {figures['param_device']}, {figures['steps']} steps over rounds "
                   f"{figures['rounds']}", figures)


def sharded_world1(ctx: Context) -> Outcome:
    """ShardedState under ``--backend auto`` on a GPU host: the FSDP2 model lives on CUDA (G6)."""
    return _sharded(ctx, "auto", "cuda")


def sharded_world1_cpu(ctx: Context) -> Outcome:
    """The sharded check's own script and harness on this host's CPU (gloo): what a CPU
    CI can run of it."""
    return _sharded(ctx, "gloo", "cpu")


def device_hang(ctx: Context) -> Outcome:
    """The positive control of the device watch: a device that does not finish queued
    work for 20 s, with --hang-timeout 8, is judged "device" and killed within ~10 s."""
    job = _job(ctx, "hang", [*WORLD1, "--backend", "auto", "--hang-timeout", "8", "--max-restarts", "2"],
               ["--device", "cuda", "--steps", "12", "--device-stall-step", "3", "--device-stall-s", "20"])
    rc = _wait_all(ctx, {"hang": job})["hang"]
    hangs = _events(job, "hang_detected")
    figures = {"rc": rc, "hangs": [{k: h.get(k) for k in ("kind", "stalled_s", "timeout_s", "where")} for h in hangs]}
    marker = job.out / "device-stall-3"
    if marker.exists() and hangs:
        stalled_at = json.loads(marker.read_text())["time"]
        figures["stall_to_verdict_s"] = round(hangs[0].get("time", stalled_at) - stalled_at, 2) \
            if isinstance(hangs[0].get("time"), (int, float)) else None
    if rc != 0 or not hangs or hangs[0].get("kind") != "device":
        return Outcome(False, f"exited {rc}, hang verdicts {[h.get('kind') for h in hangs]}", figures)
    return Outcome(True, f"device verdict after {hangs[0].get('stalled_s')}s of no progress, job finished", figures)


def cuda_snapshot_durable(ctx: Context) -> Outcome:
    """T1 and T2 (tests/gpu/test_cuda_snapshot.py, test_durable_cuda.py)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", "-rs",
           "tests/gpu/test_cuda_snapshot.py", "tests/gpu/test_durable_cuda.py"]
    child, = run_children([cmd], [child_env()], ctx.left())
    summary = (child.out.strip().splitlines() or ["no output"])[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    ok = child.rc == 0 and counts.get("passed", 0) > 0 and not counts.get("skipped")
    return Outcome(ok, summary[:300], {"rc": child.rc, **counts})


def commit_stall(ctx: Context) -> Outcome:
    """The commit-stall benchmark (benchmarks/gpu.py, G13): the figures are the point; the
    check fails only if the benchmark does not run."""
    out = ctx.workdir / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--state-mb", "512", "--steps", "20", "--rounds", "6",
           "--matmuls", "80", "--json", str(out)]
    started = time.monotonic()
    child, = run_children([cmd], [child_env()], ctx.left())
    figures = json.loads(out.read_text()) if out.exists() else {}
    figures["wall_s"] = round(time.monotonic() - started, 1)
    if child.rc != 0 or "gpu" not in figures:
        return Outcome(False, f"exited {child.rc}: {child.tail()}", figures)
    gpu = figures["gpu"]
    drain, overlap = gpu["drain"], gpu["overlap"]
    return Outcome(True, f"stall per commit against one D2H copy of {gpu['copy_s'] * 1e3:.0f} ms (goal <= 10%): "
                   f"drain {drain['stall_per_commit_s'] * 1e3:.1f} ms = {drain['stall_vs_copy']:.0%}, "
                   f"overlap {overlap['stall_per_commit_s'] * 1e3:.1f} ms = {overlap['stall_vs_copy']:.0%} "
                   f"(step {gpu['step_s'] * 1e3:.0f} ms)", figures)


__all__ = ["default_backend_e2e", "sharded_world1", "sharded_world1_cpu", "device_hang", "cuda_snapshot_durable",
           "commit_stall", "read_jsonl"]
