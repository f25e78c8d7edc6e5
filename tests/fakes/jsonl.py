"""Reading the JSON-lines files that workers, agents and fake members append to."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """Every complete line of ``path`` as JSON (no file yet: no lines), after those of its
    rotated files (``path.N`` ... ``path.1``: elastic/contract/log_files.py), oldest first.

    Writers append whole lines, so the only line that may legitimately fail to
    parse is a LAST one without its newline: it is being written right now. Any
    other bad line means a garbled file, and a check like "no failure event"
    must not pass over it, so it raises.
    """
    path = Path(path)
    rotated = sorted((p for p in path.parent.glob(path.name + ".*") if p.suffix[1:].isdigit()),
                     key=lambda p: -int(p.suffix[1:]))
    return [record for older in rotated for record in _read_one(older)] + _read_one(path)


@dataclass
class _Seen:
    """What was parsed of one file: its complete lines up to ``offset``."""

    identity: tuple  # (device, inode): a rotated or re-created file is another file
    offset: int = 0
    last_line: bytes = b""  # the line that ends at ``offset``, to notice a file rewritten in place
    records: list = field(default_factory=list)


# Tests poll the files a job appends to (steps, events) every few hundredths of a second
# while it runs; parsing them whole each time cost the test process a good part of a core
# on a long job (13 ms for 1,600 lines, 20 times a second), taken from the workers on a
# 2-core machine. Only the lines appended since the last read are parsed.
_seen: dict[str, _Seen] = {}


def _read_one(path: Path) -> list[dict]:
    key = str(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            seen = _seen.get(key)
            if seen is None or not _unchanged(f, st, seen):
                seen = _seen[key] = _Seen((st.st_dev, st.st_ino))
            f.seek(seen.offset)
            data = f.read()
    except FileNotFoundError:
        _seen.pop(key, None)
        return []
    end = data.rfind(b"\n") + 1
    torn_tail = data[end:]  # b"" when the file ends with a newline
    if end:
        first = len(seen.records) + 1
        lines = data[:end - 1].split(b"\n")
        for number, line in enumerate(lines, first):
            try:
                seen.records.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                _seen.pop(key, None)
                raise AssertionError(f"{path}:{number} is not a JSON line ({exc}): {line[:200]!r}") from None
        seen.offset += end
        seen.last_line = lines[-1] + b"\n"
    records = [dict(r) for r in seen.records]  # copies: a caller may change what it got
    if torn_tail:
        try:
            records.append(json.loads(torn_tail))
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass  # the writer is mid-line; the next read sees it whole
    return records


def _unchanged(f, st, seen: _Seen) -> bool:
    """The file is the one parsed before, with the parsed part as it was (appended to only)."""
    if (st.st_dev, st.st_ino) != seen.identity or st.st_size < seen.offset:
        return False
    if not seen.offset:
        return True
    f.seek(seen.offset - len(seen.last_line))
    return f.read(len(seen.last_line)) == seen.last_line
