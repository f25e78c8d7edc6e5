"""The on-disk layout of durable checkpoints: names, the manifest, checksums.

    <dir>/step-000000123/state.pt        torch.save of the tree (loads with weights_only=True)
    <dir>/step-000000123/manifest.json   written last; lists every file with size and sha256
    <dir>/step-000000123.1/              a later rewrite of step 123 (wins over step-000000123)
    <dir>/.tmp-step-000000123-<hex>@<host>:<pid>/   a write in progress (ignored by loaders)

A checkpoint directory is published by one rename to a name that does not exist yet,
so a rewrite of a step gets the next version suffix instead of replacing the old
directory (a rename cannot replace a non-empty directory in one step).

A checkpoint directory is valid only if its manifest parses and every file it lists
has the recorded size and sha256 (``verify_files``; a caller on a resume's critical
path may check the sizes first and the checksums later: elastic/sharded/durable.py).
One that cannot be read at all (EIO, ESTALE, a permission error: ``ManifestUnreadable``)
is neither: the storage failed, not the checkpoint, and a loader must not treat it as
corrupt (restore.py).

Checkpoint files are created 0600 and directories 0700 (``FILE_MODE``/``DIR_MODE``):
weights and optimizer state are the job's, not every user's of a shared file system.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from typing import Any, Iterable

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "STATE_NAME",
    "TMP_PREFIX",
    "DIR_MODE",
    "FILE_MODE",
    "ManifestError",
    "ManifestUnreadable",
    "build_manifest",
    "describe_os_error",
    "checkpoint_dirname",
    "file_digest",
    "fsync_dir",
    "make_private_dir",
    "open_private",
    "parse_checkpoint_dirname",
    "parse_step_dirname",
    "read_manifest",
    "step_dirname",
    "verify_files",
    "write_manifest",
]

FORMAT = 1
MANIFEST_NAME = "manifest.json"
STATE_NAME = "state.pt"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d+)(?:\.(\d+))?$")
_CHUNK = 4 << 20
# The job's user only. Not the group: a checkpoint holds the model and optimizer state
# (and the sampler's position), and on a shared cluster the group is often everyone
# of a project or a whole department; whoever needs to share the weights copies them.
FILE_MODE = 0o600
DIR_MODE = 0o700


class ManifestError(ValueError):
    """A manifest is missing, unparsable or inconsistent; str() is the reason."""


class ManifestUnreadable(ManifestError):
    """A file of the checkpoint exists but cannot be read now (EIO, ESTALE, EACCES):
    a fault of the storage, which may pass, not a corrupt checkpoint."""


def step_dirname(step: int) -> str:
    return f"step-{step:09d}"


def checkpoint_dirname(step: int, version: int = 0) -> str:
    """The name of a step's checkpoint; version n > 0 is its n-th rewrite."""
    return step_dirname(step) + (f".{version}" if version else "")


def parse_checkpoint_dirname(name: str) -> tuple[int, int] | None:
    """(step, version) of a final checkpoint directory name, None for anything else."""
    match = _STEP_DIR.match(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def parse_step_dirname(name: str) -> int | None:
    """The step of a final checkpoint directory name, None for anything else."""
    parsed = parse_checkpoint_dirname(name)
    return parsed[0] if parsed else None


def build_manifest(
    *,
    step: int,
    files: dict[str, dict[str, Any]],
    created: float,
    epoch: int | None = None,
    round: int | None = None,
    world_size: int | None = None,
    meta: dict | None = None,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "step": step,
        "epoch": epoch,
        "round": round,
        "world_size": world_size,
        "created": created,
        "files": files,
        "meta": dict(meta or {}),
    }


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    """Write and fsync manifest.json inside `directory`."""
    path = os.path.join(directory, MANIFEST_NAME)
    with open_private(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: str) -> dict[str, Any]:
    """Parse and check the manifest of a checkpoint directory; ManifestError says why not."""
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ManifestError(f"missing {MANIFEST_NAME}") from None
    except OSError as exc:
        raise ManifestUnreadable(f"cannot read {MANIFEST_NAME}: {describe_os_error(exc)}") from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"unparsable {MANIFEST_NAME}: {exc}") from None
    _check_manifest(manifest)
    return manifest


def _check_manifest(manifest: Any) -> None:
    if not isinstance(manifest, dict):
        raise ManifestError(f"{MANIFEST_NAME} is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise ManifestError(f"unsupported manifest format {manifest.get('format')!r} (expected {FORMAT})")
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ManifestError(f"bad step {step!r} in {MANIFEST_NAME}")
    files = manifest.get("files")
    if not isinstance(files, dict) or STATE_NAME not in files:
        raise ManifestError(f"{MANIFEST_NAME} does not list {STATE_NAME}")
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or not isinstance(entry.get("sha256"), str):
            raise ManifestError(f"bad entry for {name!r} in {MANIFEST_NAME}")
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise ManifestError(f"bad file name {name!r} in {MANIFEST_NAME}")


def file_digest(path: str) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def verify_files(directory: str, manifest: dict[str, Any], *, names: Iterable[str] | None = None,
                 hashes: bool = True) -> str | None:
    """None if every listed file (or every one of ``names``) has its recorded size and
    sha256, else the reason. ``hashes=False`` checks the sizes only: a stat per file,
    where the checksums read every byte (10-20 min for a checkpoint of 1 TB).

    A file that exists but cannot be read raises ``ManifestUnreadable``."""
    files = manifest["files"]
    chosen = list(files) if names is None else list(names)
    for name in chosen:
        if name not in files:
            return f"{name} is not in {MANIFEST_NAME}"
        path = os.path.join(directory, name)
        try:
            actual_size = os.path.getsize(path)
        except FileNotFoundError:
            return f"missing {name}"
        except OSError as exc:
            raise ManifestUnreadable(f"cannot read {name}: {describe_os_error(exc)}") from None
        if actual_size != files[name]["size"]:
            return f"{name} has {actual_size} bytes, manifest says {files[name]['size']}"
    if not hashes:
        return None
    for name in chosen:
        path = os.path.join(directory, name)
        try:
            _, sha = file_digest(path)
        except FileNotFoundError:
            return f"missing {name}"
        except OSError as exc:
            raise ManifestUnreadable(f"cannot read {name}: {describe_os_error(exc)}") from None
        if sha != files[name]["sha256"]:
            return f"{name} sha256 mismatch (corrupt)"
    return None


def fsync_dir(path: str) -> None:
    """Make the directory entries (creations, renames) of `path` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_private(path: str, mode: str = "wb", **kwargs):
    """``open(path, mode)`` for writing a new file that only the job's user can read
    (``FILE_MODE``, whatever the umask)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # an existing file keeps its mode through O_CREAT
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def make_private_dir(path: str) -> None:
    """``os.mkdir(path)`` with ``DIR_MODE`` whatever the umask."""
    os.mkdir(path, DIR_MODE)
    os.chmod(path, DIR_MODE)  # mkdir's mode is masked by the umask


def describe_os_error(exc: OSError) -> str:
    """'[EIO] Input/output error': the errno's name says what failed, for searching."""
    if exc.errno is not None and exc.strerror:
        return f"[{errno.errorcode.get(exc.errno, exc.errno)}] {exc.strerror}"
    return str(exc)
