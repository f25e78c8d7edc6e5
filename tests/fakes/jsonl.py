"""Reading the JSON-lines files that workers, agents and fake members append to."""

from __future__ import annotations

import json
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


def _read_one(path: Path) -> list[dict]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    torn_tail = lines.pop()  # "" when the file ends with a newline
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise AssertionError(f"{path}:{number} is not a JSON line ({exc}): {line[:200]!r}") from None
    if torn_tail:
        try:
            records.append(json.loads(torn_tail))
        except json.JSONDecodeError:
            pass  # the writer is mid-line; the next read sees it whole
    return records
