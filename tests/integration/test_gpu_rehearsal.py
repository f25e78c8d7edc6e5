"""The GPU run rehearsed on a CPU (gpu-3 N1, N2; issue 37): the two commands of docs/gpus.md,
as a bare GPU host runs them.

``make gpu-bundle PYVER=<this Python>`` builds the bundle; a fresh venv that holds torch
and nothing else (no project install, no tenacity, etcd3, grpc, protobuf, numpy) plays
the GPU image's Python; ``tests/gpu/run.sh --total-s 60`` installs the bundle offline and
runs the checks. Every CUDA check must be SKIP with its reason, the CPU checks (the
preflight, the three-agent job on gloo) must pass, and the output folder must hold the
JSON lines, the summary, the console and the log archive, and nothing else.

Slow (CI runs it): the bundle's download and build, and a job of three agents.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _requirements(name: str) -> list[str]:
    found = []
    for requirement in importlib.metadata.requires(name) or ():
        if "extra ==" in requirement:
            continue
        found.append(re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0])
    return found


def _top_level(name: str) -> set[str]:
    dist = importlib.metadata.distribution(name)
    return {str(f).split("/")[0] for f in dist.files or () if not str(f).startswith("..")} - {"__pycache__"}


def torch_only_venv(at: Path) -> Path:
    """A venv (with pip) whose only packages are torch and what torch requires, linked
    from this environment rather than installed again (seconds instead of minutes)."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(at)], check=True, capture_output=True)
    python = at / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    linked = at / "torch-only"
    linked.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for entry in _top_level(name):
            source = Path(dist.locate_file(entry))
            if source.exists() and not (linked / entry).exists():
                (linked / entry).symlink_to(source)
        todo += _requirements(name)
    Path(purelib, "torch-only.pth").write_text(str(linked) + "\n")
    return python


def test_the_gpu_run_rehearsed_in_a_venv_of_torch_alone(tmp_path):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    bundle = tmp_path / "bundle"
    started = time.monotonic()
    built = subprocess.run(["make", "-s", "gpu-bundle", f"PYVER={version}", f"GPU_BUNDLE_DIR={bundle}"], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    build_s = time.monotonic() - started
    assert built.returncode == 0, built.stderr[-2000:]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["python"] == version and manifest["total_bytes"] <= 40e6
    assert any(w["file"].startswith("elastic_run-") for w in manifest["wheels"])

    python = torch_only_venv(tmp_path / "bare")
    bare = subprocess.run([str(python), "-c", "import torch, importlib.util as u; "
                           "print([m for m in ('elastic', 'tenacity', 'etcd3', 'grpc', 'numpy') if u.find_spec(m)])"],
                          cwd=tmp_path, capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert bare.returncode == 0 and bare.stdout.strip() == "[]", (bare.stdout, bare.stderr[-1000:])

    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("ELASTIC_", "VIRTUAL_ENV"))}
    env.update(GPU_PY=str(python), GPU_BUNDLE=str(bundle), TMPDIR=str(tmp_path))
    started = time.monotonic()
    run = subprocess.run(["bash", str(REPO / "tests" / "gpu" / "run.sh"), "--out", str(out), "--total-s", "60"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    run_s = time.monotonic() - started
    console = run.stdout + run.stderr
    assert run.returncode == 0, console[-4000:]
    assert run_s < 75, (run_s, console[-2000:])

    assert sorted(p.name for p in out.iterdir()) == ["checks.jsonl", "console.txt", "logs.tgz", "summary.json"]
    entries = [json.loads(line) for line in (out / "checks.jsonl").read_text().splitlines()]
    by_name = {e["name"]: e for e in entries}
    from tests.gpu.check import CHECKS

    assert [e["name"] for e in entries] == [c.name for c in CHECKS]  # one line each, in the plan's order
    for check in CHECKS:
        entry = by_name[check.name]
        if "cuda" in check.needs:
            assert entry["status"] == "SKIP" and "no CUDA here" in entry["detail"], entry
    preflight = by_name["preflight"]
    assert preflight["status"] == "PASS", preflight
    imports = preflight["figures"]["imports"]
    assert all(str(tmp_path) in imports[m] and "/site/" in imports[m]
               for m in ("elastic", "elastic.rendezvous", "elastic.checkpoint", "tenacity", "etcd3")), imports
    assert preflight["figures"]["etcd_binary"].startswith(str(tmp_path))
    assert by_name["three_agents_kill_cpu"]["status"] == "PASS", by_name["three_agents_kill_cpu"]
    assert "equal final weights" in by_name["three_agents_kill_cpu"]["detail"]

    summary = json.loads((out / "summary.json").read_text())
    assert [e["name"] for e in summary["checks"]] == [e["name"] for e in entries]
    assert "PASS preflight" in (out / "console.txt").read_text() and "install_bundle:" in console
    with tarfile.open(out / "logs.tgz") as archive:
        names = archive.getnames()
    assert "preflight.log" in names and any(n.startswith("three_agents_kill_cpu/a/") for n in names), names
    assert not list(tmp_path.glob("elastic-gpu-bundle.*")), "run.sh left its private folder behind"
    print(f"bundle {manifest['total_bytes'] / 1e6:.1f} MB built in {build_s:.0f}s; run.sh {run_s:.0f}s")
