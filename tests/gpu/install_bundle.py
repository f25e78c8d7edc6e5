"""Install the GPU bundle (``make gpu-bundle``) into a private site folder, offline.

    python3 tests/gpu/install_bundle.py --bundle gpu-bundle --site DIR

Run by ``tests/gpu/run.sh`` with the GPU host's own Python, before anything of the
project can be imported: standard library only. It checks the bundle against its
``manifest.json`` (this Python's version, every file's sha256), installs the wheels
with ``pip install --no-index --no-deps --target DIR/site`` (or, where this Python has
no pip, by unpacking them, which is what pip does for these wheels), except those the
manifest marks ``only_if_missing`` that this Python already has (numpy: the image's own
is kept, the one torch was built against), and unpacks the etcd server to
``DIR/bin/etcd``. Nothing is fetched, nothing outside ``DIR`` is
written. One line on success, one line and exit status 1 on any problem.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path


class InstallError(Exception):
    pass


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(bundle: Path) -> dict:
    path = bundle / "manifest.json"
    if not path.is_file():
        raise InstallError(f"{path} is missing: run `make gpu-bundle` on a machine with network and carry "
                           f"the folder {bundle.name}/ with the repository")
    manifest = json.loads(path.read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != here:
        raise InstallError(f"the bundle is for Python {manifest['python']}, this is {here} ({sys.executable}): "
                           f"make gpu-bundle PYVER={here}")
    for wheel in manifest["wheels"]:
        if sha256(bundle / wheel["file"]) != wheel["sha256"]:
            raise InstallError(f"{wheel['file']} does not match its sha256 in the manifest (a partial copy?)")
    return manifest


def _unpack_wheel(wheel: Path, site: Path) -> None:
    """A wheel's files into ``site``: its root, and its ``.data/purelib|platlib`` folders."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts and headers: not needed to import
                parts = parts[2:]
            target = site.joinpath(*parts)
            if info.is_dir():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)


def _has_pip() -> bool:
    return subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0


def install(bundle: Path, prefix: Path) -> dict:
    started = time.monotonic()
    manifest = read_manifest(bundle)
    site, bin_dir = prefix / "site", prefix / "bin"
    for folder in (site, bin_dir):
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
    wheels = [bundle / w["file"] for w in manifest["wheels"]
              if not (w.get("only_if_missing") and importlib.util.find_spec(w["only_if_missing"]))]
    kept = [w["only_if_missing"] for w in manifest["wheels"]
            if w.get("only_if_missing") and bundle / w["file"] not in wheels]
    if _has_pip():
        how = "pip --no-index"
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--disable-pip-version-check", "--target", str(site),
                               *map(str, wheels)], capture_output=True, text=True)
        if done.returncode != 0:
            said = [line for line in done.stderr.splitlines() if "ERROR" in line] or done.stderr.splitlines()[-1:]
            raise InstallError(f"pip install --no-index failed: {' '.join(said)[:400]}")
    else:
        how = "unpacked (no pip in this Python)"
        for wheel in wheels:
            _unpack_wheel(wheel, site)
    etcd = bin_dir / "etcd"
    with lzma.open(bundle / manifest["etcd"]["file"], "rb") as source, open(etcd, "wb") as out:
        shutil.copyfileobj(source, out, 1 << 20)
    if sha256(etcd) != manifest["etcd"]["sha256"]:
        raise InstallError("the unpacked etcd does not match its sha256 in the manifest")
    os.chmod(etcd, 0o755)
    return {"how": how, "wheels": len(wheels), "kept": kept, "site": str(site), "etcd": str(etcd),
            "etcd_version": manifest["etcd"]["version"], "commit": manifest.get("commit"),
            "seconds": round(time.monotonic() - started, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True, help="the folder `make gpu-bundle` wrote")
    parser.add_argument("--prefix", required=True, help="where site/ and bin/ go (a private folder)")
    args = parser.parse_args(argv)
    try:
        found = install(Path(args.bundle), Path(args.prefix))
    except (InstallError, OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        print(f"install_bundle: {type(exc).__name__ if not isinstance(exc, InstallError) else 'error'}: {exc}",
              file=sys.stderr)
        return 1
    kept = f" (this Python's own {', '.join(found['kept'])} kept)" if found["kept"] else ""
    print(f"install_bundle: {found['wheels']} wheels ({found['how']}){kept} into {found['site']}, etcd "
          f"{found['etcd_version']} at {found['etcd']}, bundle of {found['commit']}, {found['seconds']:g}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
