"""Finding and loading the newest valid durable checkpoint.

Loaders look only at ``step-<n>[.<version>]`` directories (a ``.tmp-*`` directory is a write in
progress or the leftover of a crash) and trust a checkpoint only after its manifest
parses and every file matches its recorded size and sha256. The state is loaded with
``torch.load(weights_only=True)``: never unpickles arbitrary objects.

A checkpoint that is corrupt (a checksum that does not match, a missing or unparsable
manifest) is skipped with one warning line, for the next older one. A checkpoint that
exists but cannot be read now (EIO or ESTALE from a file server, a permission error) is
not: skipping it would start the job from an older state, or from the initial one, and
the new run's writes would later bury the real progress. The scan is retried with a
bounded backoff, then ``CheckpointsUnreadable`` names them, unless the caller asked to
skip them (``skip_unreadable``, elastic-run's ``--checkpoint-allow-fresh-start``).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from . import manifest as mf
from .durable import check_local_directory

__all__ = ["RETRY_DELAYS", "CheckpointInfo", "CheckpointsUnreadable", "find_newest", "list_checkpoints",
           "load_latest", "with_retries"]

logger = logging.getLogger(__name__)

# Seconds between the scans of a directory whose checkpoints cannot be read: half a
# minute in all, which outlasts an NFS server's failover or a remount, and stays below
# the default --collective-timeout (60 s) that the other workers wait for this one in.
RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0)
T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    step: int | None
    created: float | None  # unix time from the manifest
    size: int  # bytes of all files in the directory
    valid: bool
    reason: str | None  # why not valid
    manifest: dict | None
    unreadable: bool = False  # not valid because the storage failed, not the checkpoint


class CheckpointsUnreadable(Exception):
    """Checkpoints exist in ``directory`` but cannot be read; ``unreadable`` lists
    (path, reason). str() is one line naming them."""

    def __init__(self, directory: str, unreadable: Sequence[tuple[str, str]], advice: str = ""):
        self.directory = directory
        self.unreadable = list(unreadable)
        named = "; ".join(f"{os.path.basename(path) or path}: {reason}" for path, reason in self.unreadable[:4])
        more = f"; and {len(self.unreadable) - 4} more" if len(self.unreadable) > 4 else ""
        advice = f"; {advice}" if advice else ""
        super().__init__(f"checkpoints present but unreadable in {directory}: {named}{more}{advice}")


def _candidates(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every final checkpoint directory, newest (highest step) first.

    A directory that does not exist has none; one that cannot be listed raises
    ``CheckpointsUnreadable`` (it may hold any number of checkpoints)."""
    check_local_directory(directory)
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise CheckpointsUnreadable(directory, [(directory, _strerror(exc))]) from None
    found = []
    for name in names:
        parsed = mf.parse_checkpoint_dirname(name)
        if parsed is not None:
            found.append((parsed, os.path.join(directory, name)))
    found.sort(reverse=True)  # a rewrite of a step (higher version) before the step's older copy
    return [(step, path) for (step, _), path in found]


def _dir_size(path: str) -> int:
    total = 0
    try:
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def _inspect(step: int, path: str, hashes: bool = True) -> Optional[CheckpointInfo]:
    """What ``path`` is as a checkpoint; None when it is not a directory (not one).
    ``hashes=False``: its files' sizes are checked, not their checksums."""
    manifest, unreadable = None, False
    try:
        if not os.path.isdir(path):
            os.stat(path)  # isdir hides why: a file, or a stat that fails (EIO, ESTALE)?
            return None
        manifest = mf.read_manifest(path)
        reason = mf.verify_files(path, manifest, hashes=hashes)
        if reason is None and manifest["step"] != step:
            reason = f"manifest step {manifest['step']} does not match the directory name"
    except FileNotFoundError:
        return None  # removed meanwhile (pruned by a writer)
    except OSError as exc:
        reason, unreadable = f"cannot read it: {_strerror(exc)}", True
    except mf.ManifestUnreadable as exc:
        reason, unreadable = str(exc), True
    except mf.ManifestError as exc:
        reason = str(exc)
    created = manifest.get("created") if manifest else None
    return CheckpointInfo(
        path=path,
        step=step,
        created=created if isinstance(created, (int, float)) else None,
        size=_dir_size(path),
        valid=reason is None,
        reason=reason,
        manifest=manifest,
        unreadable=unreadable,
    )


def list_checkpoints(directory: str) -> list[CheckpointInfo]:
    """Every checkpoint of `directory`, newest first, with checksums verified.

    A directory that does not exist has no checkpoints ([]); one that cannot be listed
    raises ``CheckpointsUnreadable``.
    """
    return [info for info in (_inspect(step, path) for step, path in _candidates(directory)) if info is not None]


def find_newest(directory: str, *, accept: Callable[[CheckpointInfo], Optional[str]] = lambda info: None,
                load: Callable[[CheckpointInfo], Any] = lambda info: None,
                skip_unreadable: bool = False, hashes: bool = True) -> Optional[tuple[CheckpointInfo, Any]]:
    """(info, load(info)) of the newest valid checkpoint that ``accept``s (returns no
    reason against it) and loads, or None. One scan, no retries (``with_retries``).

    Corrupt or refused checkpoints newer than it are skipped with one warning line
    each. An unreadable one newer than it raises ``CheckpointsUnreadable`` naming
    every unreadable one seen, unless ``skip_unreadable``; the older valid checkpoint
    is then not loaded (nor its data read): only verified. ``load`` raising OSError
    counts as unreadable, anything else as corrupt. ``hashes=False`` checks the manifest
    and the files' sizes only, for a caller that verifies the checksums itself, off the
    path every worker waits on (a sharded resume: elastic/sharded/durable.py).
    """
    unreadable: list[tuple[str, str]] = []
    for step, path in _candidates(directory):
        info = _inspect(step, path, hashes)
        if info is None:
            continue
        reason = info.reason if not info.valid else accept(info)
        if info.valid and reason is None:
            if unreadable and not skip_unreadable:
                break
            try:
                return info, load(info)
            except FileNotFoundError as exc:
                reason = f"cannot be loaded: {_strerror(exc)}"
            except OSError as exc:
                info = replace(info, valid=False, unreadable=True,
                               reason=f"{mf.STATE_NAME} cannot be read: {_strerror(exc)}")
                reason = info.reason
            except Exception as exc:  # noqa: BLE001 - any other load failure means "not usable"
                first_line = (str(exc).strip().splitlines() or [""])[0]
                reason = f"{mf.STATE_NAME} cannot be loaded: {type(exc).__name__}: {first_line}"
        if info.unreadable:
            unreadable.append((path, reason))
            if skip_unreadable:
                logger.warning("skipping unreadable checkpoint %s (as asked): %s", path, reason)
            continue
        logger.warning("skipping checkpoint %s: %s", path, reason)
    if unreadable and not skip_unreadable:
        raise CheckpointsUnreadable(directory, unreadable)
    return None


def with_retries(scan: Callable[[], T], *, delays: Optional[Sequence[float]] = None,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """``scan()``, again after each of ``delays`` (default ``RETRY_DELAYS``) while it raises
    ``CheckpointsUnreadable``; the last one's error if it never passes."""
    for delay in RETRY_DELAYS if delays is None else delays:
        try:
            return scan()
        except CheckpointsUnreadable as exc:
            logger.warning("%s; retrying in %g s", exc, delay)
        sleep(delay)
    return scan()


def load_latest(directory: str, *, skip_unreadable: bool = False, delays: Optional[Sequence[float]] = None,
                sleep: Callable[[float], None] = time.sleep) -> tuple[Any, dict] | None:
    """(tree, manifest) of the newest valid checkpoint, or None if there is none.

    Each corrupt checkpoint newer than the one loaded is skipped with one warning line
    that names it and says why. Checkpoints that cannot be read (the storage fails)
    are scanned for again after each of ``delays``, then ``CheckpointsUnreadable``
    names them, unless ``skip_unreadable``.
    """
    def load(info: CheckpointInfo) -> Any:
        return torch.load(os.path.join(info.path, mf.STATE_NAME), map_location="cpu", weights_only=True)

    found = with_retries(lambda: find_newest(directory, load=load, skip_unreadable=skip_unreadable),
                         delays=delays, sleep=sleep)
    if found is None:
        return None
    info, tree = found
    return tree, info.manifest


_strerror = mf.describe_os_error
