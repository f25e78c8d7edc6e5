"""``elastic-run timeline LOG_DIR -o FILE.png``: bad input is one line and exit 1."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from ..contract.log_files import log_paths
from ..timeline.model import Timeline, build
from .extras import MissingExtra, require

EVENTS_FILE = "events.jsonl"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ValueError(message)


def find_events_files(log_dir: str) -> list[str]:
    """Every events.jsonl at or below ``log_dir`` (one per host's log directory), each
    after its rotated files (``events.jsonl.N``, oldest first: contract/log_files.py)."""
    found = []
    for root, dirs, files in os.walk(log_dir):
        dirs.sort()
        if EVENTS_FILE in files or EVENTS_FILE + ".1" in files:
            found.extend(log_paths(os.path.join(root, EVENTS_FILE)))
    return found


def read_events(paths: Sequence[str]) -> list[dict]:
    events = []
    for path in paths:
        with open(path, "rb") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line torn by a killed writer
                if isinstance(event, dict):
                    events.append(event)
    return events


def load(log_dir: str) -> Timeline:
    """The timeline of the job whose logs are in ``log_dir``; ValueError says why not."""
    if not os.path.isdir(log_dir):
        raise ValueError(f"{log_dir}: no such directory")
    paths = find_events_files(log_dir)
    if not paths:
        raise ValueError(f"{log_dir}: no {EVENTS_FILE} in it or below it (was the job run with --log-dir?)")
    try:
        return build(read_events(paths))
    except ValueError:
        raise ValueError(f"{log_dir}: no events in {', '.join(paths)}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _Parser(prog="elastic-run timeline",
                     description="Draw what a job did (world size, each worker's steps, failures, joins, "
                                 "re-formations and their phases) from the events.jsonl files under LOG_DIR.")
    parser.add_argument("log_dir", metavar="LOG_DIR", help="the job's --log-dir (or a directory holding several)")
    parser.add_argument("-o", "--output", metavar="FILE.png", default="timeline.png", help="(default timeline.png)")
    try:
        args = parser.parse_args(argv)
        timeline = load(args.log_dir)
    except (ValueError, OSError) as exc:
        print(f"elastic-run timeline: error: {exc}", file=sys.stderr)
        return 1
    try:
        require("matplotlib", "timeline", "drawing the timeline")
    except MissingExtra as exc:
        print(f"elastic-run timeline: error: {exc}", file=sys.stderr)
        return 1
    from ..timeline.draw import render
    try:
        render(timeline, args.output)
    except OSError as exc:
        print(f"elastic-run timeline: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"{args.output}: {timeline.headline()}")
    return 0
