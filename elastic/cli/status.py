"""``elastic-run status``: what is my job doing? From etcd alone, from any terminal.

    elastic-run status --rdzv-endpoint E --job-id J [--json] [--watch] [TLS/auth options]

Exit status: 0 when the job was found, 1 when etcd holds nothing of it (an unknown
id, or a job that ended more than a day ago: see rendezvous/history.py) or etcd
cannot be reached, 2 for bad options. Each error is one line on stderr.
``--watch`` draws the view again every two seconds until Ctrl-C (exit 0).
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import asdict
import json
import sys
import threading
import time
from typing import Callable, Optional, Sequence

from elastic.rendezvous import ConfigError, Etcd, JobKeys, RendezvousError, validate_job_id
from elastic.rendezvous.job_view import JobView, job_view, read_job

from ..timeline.progress import JobProgress
from . import etcd_secrets
from .options import (ETCD_OPTIONS, JOB_OPTIONS, USAGE_ERROR, OptionParser, add_allow_insecure, add_option,
                      coerce_env_values, etcd_config)

NOT_FOUND = 1
WATCH_INTERVAL_S = 2.0
# A status read must answer promptly: etcd away is one line, not a 30 s retry.
_READ_DEADLINE_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(prog="elastic-run status", description="Show what an elastic job is doing, or how it ended, "
                "from etcd alone.")
    add_option(p, "--rdzv-endpoint", help="the job's etcd v3 endpoints HOST:PORT[,HOST:PORT...]")
    for flag, text in [o for o in JOB_OPTIONS if o[0] != "--rdzv-endpoint"] + list(ETCD_OPTIONS):
        add_option(p, flag, help=text)
    add_allow_insecure(p)
    p.add_argument("--json", action="store_true", help="one JSON object (with --watch: one per line)")
    p.add_argument("--watch", action="store_true", help="draw again every 2 s until Ctrl-C")
    return p


def _ago(then: Optional[float], now: float) -> str:
    if not then:
        return "-"
    stamp = datetime.datetime.fromtimestamp(then).strftime("%H:%M:%S")
    return f"{stamp} ({_duration(max(0.0, now - then))} ago)"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def render_text(view: JobView, now: float, progress: Optional[JobProgress] = None) -> str:
    """The human view: a few lines of state and progress, then members, rounds and requests."""
    state = view.state + (f": {view.reason}" if view.reason else "")
    lines = [f"job {view.job_id}: {state}" + (f" (since {_ago(view.since, now)})" if view.since else "")]
    if view.round is not None:
        lines.append(f"round {view.round}, world size {view.world_size}")
    if progress is not None:
        lines.extend(progress.lines(now))
    by_id = {m.member_id: m for m in view.members}
    if view.coordinator:
        leader = by_id.get(view.coordinator)
        lines.append(f"coordinator: {leader.host} ({view.coordinator})" if leader else
                     f"coordinator: {view.coordinator}")
    if view.note:
        lines.append(f"note: {view.note}")
    if view.history_expires_in is not None:
        lines.append(f"ended: this record expires in {_duration(view.history_expires_in)}")
    lines.append("")
    lines.append(f"members ({len(view.members)}):")
    for m in view.members:
        ranks = ", ".join(f"{w.worker_id.rsplit('.', 1)[-1]}=rank {w.rank}" if w.rank is not None else
                          f"{w.worker_id.rsplit('.', 1)[-1]}=spare" for w in m.workers) or "no workers"
        flags = "".join([" [coordinator]" if m.coordinator else "", " [leaving]" if m.draining else ""])
        lines.append(f"  {m.host:<16} {m.addr:<15} {ranks}  (joined {_ago(m.joined, now)}){flags}")
    if view.rounds:
        lines.append("")
        lines.append("recent rounds:")
        for r in view.rounds:
            lost = f", {r.lost} lost" if r.lost else ""
            lines.append(f"  {r.round:>5}  {_ago(r.time, now):<22} world {r.world_size:<4} {r.reason}{lost}")
    if view.requests:
        lines.append("")
        lines.append("pending reset requests:")
        for q in view.requests:
            lines.append(f"  {q.worker_id} after round {q.round}: {q.reason}")
    return "\n".join(lines)


def _view(etcd: Etcd, keys: JobKeys) -> Optional[tuple[JobView, Optional[JobProgress]]]:
    snapshot = read_job(etcd, keys, now=time.time(), deadline=_READ_DEADLINE_S)
    return None if snapshot is None else (job_view(snapshot), progress_of_snapshot(snapshot.values))


def progress_of_snapshot(values: dict) -> Optional[JobProgress]:
    """The progress rank 0's agent publishes (agent/run_watch.py); None if absent or unreadable."""
    raw = values.get("progress")  # JobKeys.progress, below the job's prefix
    if not raw:
        return None
    try:
        return JobProgress.from_json(raw)
    except (TypeError, ValueError):
        return None  # a malformed value: status shows the rest, not a traceback


def _show(shown: tuple[JobView, Optional[JobProgress]], as_json: bool, out) -> None:
    view, progress = shown
    if as_json:
        data = view.to_dict()
        if progress is not None:
            known = {k: v for k, v in asdict(progress).items() if v is not None}
            data["progress"] = {**known, "eta_s": progress.eta_s()}
        out.write(json.dumps(data, separators=(",", ":")) + "\n")
    else:
        out.write(render_text(view, time.time(), progress) + "\n")
    out.flush()


def main(argv: Sequence[str], *, out=None, stopped: Optional[Callable[[float], bool]] = None) -> int:
    out = out or sys.stdout
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv))
        coerce_env_values(parser, args)
        if not args.rdzv_endpoint or not args.job_id:
            raise ConfigError("give --rdzv-endpoint and --job-id (or ELASTIC_RDZV_ENDPOINT and ELASTIC_JOB_ID)")
        keys = JobKeys(validate_job_id(args.job_id))
        etcd_secrets.apply_job_secret(args)  # ELASTIC_JOB_SECRET[_FILE]: the job's own etcd
        config = etcd_config(args)
    except ConfigError as exc:
        print(f"elastic-run status: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    etcd = Etcd(config)
    try:
        etcd.check()
        view = _view(etcd, keys)
        if view is None:
            print(f"elastic-run status: no job {args.job_id} at {config.describe()} "
                  "(unknown, or ended over a day ago)", file=sys.stderr)
            return NOT_FOUND
        if not args.watch:
            _show(view, args.json, out)
            return 0
        return _watch(etcd, keys, args.json, out, view, stopped or threading.Event().wait)
    except RendezvousError as exc:
        print(f"elastic-run status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0  # Ctrl-C ends --watch (or a slow read): nothing went wrong
    finally:
        etcd.close()


def _watch(etcd: Etcd, keys: JobKeys, as_json: bool, out, view: Optional[tuple],
           stopped: Callable[[float], bool]) -> int:
    """Draw, wait, read again, until Ctrl-C. A failed read is shown and tried again."""
    clear = not as_json and out.isatty()
    while True:
        if clear:
            out.write("\x1b[H\x1b[2J")
        if view is not None:
            _show(view, as_json, out)
        if stopped(WATCH_INTERVAL_S):
            return 0
        try:
            view = _view(etcd, keys)
            if view is None:
                out.write(f"job {keys.job_id}: no longer in etcd\n")
        except RendezvousError as exc:
            view = None
            out.write(f"elastic-run status: {exc}; trying again\n")
        out.flush()
