"""`python -m elastic.checkpoint DIR` (and `elastic-run checkpoints DIR`): list and verify checkpoints.

Exit status: 0 if at least one checkpoint is valid, 1 if none is, 2 if DIR is unusable.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

from .restore import CheckpointInfo, CheckpointsUnreadable, list_checkpoints

__all__ = ["main", "format_table"]


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _iso(created: float | None) -> str:
    if created is None:
        return "-"
    return datetime.datetime.fromtimestamp(created).astimezone().isoformat(timespec="seconds")


def format_table(infos: list[CheckpointInfo]) -> str:
    rows = [("STEP", "CREATED", "SIZE", "NAME", "STATUS")]
    for info in infos:
        status = "valid" if info.valid else f"{'UNREADABLE' if info.unreadable else 'INVALID'}: {info.reason}"
        step = "-" if info.step is None else str(info.step)
        rows.append((step, _iso(info.created), _human_size(info.size), os.path.basename(info.path), status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(w) if i else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="elastic-run checkpoints",
        description="List the durable checkpoints of a directory, newest first, verifying checksums.",
    )
    parser.add_argument("directory", help="the job's --checkpoint-dir")
    args = parser.parse_args(argv)
    directory = args.directory
    if not os.path.isdir(directory):
        what = "does not exist" if not os.path.exists(directory) else "is not a directory"
        print(f"error: checkpoint directory {directory} {what}", file=sys.stderr)
        return 2
    try:
        infos = list_checkpoints(directory)
    except (OSError, ValueError, CheckpointsUnreadable) as exc:
        print(f"error: cannot list {directory}: {exc}", file=sys.stderr)
        return 2
    if not infos:
        print(f"no checkpoints in {directory}")
        return 1
    print(format_table(infos))
    valid = sum(info.valid for info in infos)
    print(f"{valid} of {len(infos)} checkpoints valid")
    return 0 if valid else 1
