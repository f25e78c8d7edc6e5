"""Finding and loading the newest valid durable checkpoint.

Loaders look only at ``step-<n>[.<version>]`` directories (a ``.tmp-*`` directory is a write in
progress or the leftover of a crash) and trust a checkpoint only after its manifest
parses and every file matches its recorded size and sha256. The state is loaded with
``torch.load(weights_only=True)``: never unpickles arbitrary objects.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from . import manifest as mf
from .durable import check_local_directory

__all__ = ["CheckpointInfo", "list_checkpoints", "load_latest"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    step: int | None
    created: float | None  # unix time from the manifest
    size: int  # bytes of all files in the directory
    valid: bool
    reason: str | None  # why not valid
    manifest: dict | None


def _candidates(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every final checkpoint directory, newest (highest step) first."""
    check_local_directory(directory)
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        parsed = mf.parse_checkpoint_dirname(name)
        path = os.path.join(directory, name)
        if parsed is not None and os.path.isdir(path):
            found.append((parsed, path))
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


def _inspect(step: int, path: str) -> CheckpointInfo:
    manifest = None
    try:
        manifest = mf.read_manifest(path)
        reason = mf.verify_files(path, manifest)
        if reason is None and manifest["step"] != step:
            reason = f"manifest step {manifest['step']} does not match the directory name"
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
    )


def list_checkpoints(directory: str) -> list[CheckpointInfo]:
    """Every checkpoint of `directory`, newest first, with checksums verified.

    A directory that does not exist has no checkpoints ([]).
    """
    return [_inspect(step, path) for step, path in _candidates(directory)]


def load_latest(directory: str) -> tuple[Any, dict] | None:
    """(tree, manifest) of the newest valid checkpoint, or None if there is none.

    Each invalid checkpoint newer than the one loaded is skipped with one warning line
    that names it and says why.
    """
    for step, path in _candidates(directory):
        info = _inspect(step, path)
        if info.valid:
            try:
                tree = torch.load(os.path.join(path, mf.STATE_NAME), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any load failure means "not usable"
                first_line = (str(exc).strip().splitlines() or [""])[0]
                logger.warning("skipping checkpoint %s: %s cannot be loaded: %s: %s",
                               path, mf.STATE_NAME, type(exc).__name__, first_line)
                continue
            return tree, info.manifest
        logger.warning("skipping checkpoint %s: %s", path, info.reason)
    return None
