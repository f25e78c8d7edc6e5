"""Where the GPU checks' results go: a few files in one folder, each up to date after every check.

A lent GPU machine brings back at most 8 files, and a command cut off at its limit
brings back what its files held at that moment (gpu review N2). So ``Results`` writes:

    checks.jsonl   one JSON line per check, appended and fsync'ed as the check ends
                   (before the next one starts): name, finding, status, detail,
                   seconds, figures
    summary.json   versions, what the preflight found, every entry so far; rewritten
                   atomically after each check
    logs.tgz       every check's files (its log, its children's output, the jobs'
                   consoles and events), each cut to its last LOG_TAIL_BYTES, the
                   archive capped at ARCHIVE_LIMIT_BYTES; rewritten after each phase

and ``tests/gpu/run.sh`` copies the console to ``console.txt`` beside them.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path
from typing import Optional

LOG_TAIL_BYTES = 256 * 1024
ARCHIVE_LIMIT_BYTES = 15 * 1024 * 1024  # under the 16 MiB a returned file may have
SKIPPED_SUFFIXES = (".pt", ".distcp", ".bin", ".db", ".wal", ".snap")  # weights, checkpoints, etcd's data


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Results:
    """The output folder of one run (``--out``)."""

    def __init__(self, out: Path, workdir: Path, header: Optional[dict] = None):
        self.out = out
        self.workdir = workdir
        self.header = dict(header or {})
        self.entries: list[dict] = []
        self.started = time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        self.lines = out / "checks.jsonl"
        self.lines.write_text("")

    def record(self, entry: dict) -> None:
        """One check's entry: its JSON line now (flushed to disk), then the summary."""
        entry = {**entry, "t": round(time.monotonic() - self.started, 1)}
        self.entries.append(entry)
        with open(self.lines, "a") as f:
            f.write(json.dumps(entry, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.write_summary()

    def write_summary(self, **more) -> None:
        self.header.update(more)
        report = {**self.header, "elapsed_s": round(time.monotonic() - self.started, 1), "checks": self.entries}
        _write_atomically(self.out / "summary.json", (json.dumps(report, indent=1, default=str) + "\n").encode())

    def pack_logs(self) -> dict:
        """Every file under the work folder into ``logs.tgz`` (tails, capped); what went in."""
        buffer = io.BytesIO()
        added = skipped = 0
        with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as archive:
            for path in sorted(p for p in self.workdir.rglob("*") if p.is_file()):
                if path.suffix in SKIPPED_SUFFIXES or "member" in path.relative_to(self.workdir).parts:
                    skipped += 1
                    continue
                if buffer.tell() > ARCHIVE_LIMIT_BYTES - LOG_TAIL_BYTES:
                    skipped += 1
                    continue
                try:
                    size = path.stat().st_size
                    with open(path, "rb") as f:
                        f.seek(max(0, size - LOG_TAIL_BYTES))
                        data = f.read(LOG_TAIL_BYTES)
                except OSError:
                    skipped += 1
                    continue
                info = tarfile.TarInfo(str(path.relative_to(self.workdir)))
                info.size, info.mtime = len(data), int(path.stat().st_mtime)
                archive.addfile(info, io.BytesIO(data))
                added += 1
        _write_atomically(self.out / "logs.tgz", buffer.getvalue())
        return {"files": added, "left_out": skipped, "bytes": len(buffer.getvalue())}
