"""The index of a sharded data set: each shard's sample count, counted once and cached.

Counting a shard can mean reading all of it (the lines of a JSON-lines file), so the
counts are kept in a small JSON file, by default beside the data (``cache_dir`` puts it
elsewhere, e.g. the job's directory when the data is read-only). Every later start
checks each cached entry against its file's size and modification time and counts
again only the shards that changed; a cache that cannot be written is said once and
the counts are kept in memory. One cache per reader ``key``: the same token files cut
into samples of another length have other counts.

The index's ``digest`` (the shards' names and counts) is committed with a
``SourceSampler``'s cursor: a resume over other data is refused, not trained on.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

log = logging.getLogger(__name__)

_VERSION = 1


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the index knows it (``size``/``mtime_ns`` are -1 for a shard that is no file)."""

    name: str
    count: int
    size: int = -1
    mtime_ns: int = -1


def _is_file(shard: Any) -> bool:
    return isinstance(shard, (str, os.PathLike)) and os.path.isfile(shard)


def cache_path(shards: Sequence[Any], reader_key: str, cache_dir: Optional[str] = None) -> Optional[Path]:
    """Where the counts of these shards, cut by ``reader_key``, are cached (None: not files)."""
    files = [os.path.abspath(s) for s in shards if _is_file(s)]
    if not files or len(files) != len(shards):
        return None
    name = hashlib.sha256(json.dumps([reader_key, files]).encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else Path(os.path.commonpath([os.path.dirname(f) for f in files]))
    return folder / f".elastic-index-{name}.json"


def counts_digest(counts: Sequence[int]) -> str:
    """The digest of shards known by their counts only (no names)."""
    return hashlib.sha256(json.dumps([int(c) for c in counts]).encode()).hexdigest()[:16]


class ShardIndex:
    """The shards' sample counts, in the order the shards were given."""

    def __init__(self, entries: Sequence[ShardEntry]):
        self.entries = list(entries)
        self.counts = [entry.count for entry in self.entries]
        self.total = sum(self.counts)
        self.recounted = 0  # shards counted by this build (0 when the cache held them all)

    @property
    def digest(self) -> str:
        """The shards' names and counts, hashed: what a committed cursor was counted over."""
        payload = json.dumps([[os.path.basename(e.name), e.count] for e in self.entries])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    @classmethod
    def build(cls, shards: Sequence[Any], reader, cache_dir: Optional[str] = None) -> "ShardIndex":
        """Count each shard with ``reader.count``, reusing the cached counts of unchanged files."""
        path = cache_path(shards, reader.key, cache_dir)
        with _counting(path):
            return cls._build(shards, reader, path)

    @classmethod
    def _build(cls, shards: Sequence[Any], reader, path: Optional[Path]) -> "ShardIndex":
        cached = _read_cache(path, reader.key) if path is not None else {}
        entries, recounted = [], 0
        for shard in shards:
            name = os.path.abspath(shard) if _is_file(shard) else str(shard)
            size, mtime = -1, -1
            if _is_file(shard):
                stat = os.stat(shard)
                size, mtime = stat.st_size, stat.st_mtime_ns
            hit = cached.get(name)
            if hit is not None and size >= 0 and hit.size == size and hit.mtime_ns == mtime:
                entries.append(hit)
                continue
            count = reader.count(shard)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"the reader counted {count!r} samples in shard {name}: a count is an integer >= 0")
            entries.append(ShardEntry(name, count, size, mtime))
            recounted += 1
        index = cls(entries)
        index.recounted = recounted
        if path is not None and recounted:
            _write_cache(path, reader.key, entries)
        return index


@contextlib.contextmanager
def _counting(path: Optional[Path]):
    """One process of a host counts, the others wait and read its cache: every rank of a
    job builds the index at its start, and counting a JSON-lines shard reads all of it."""
    if path is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(f"{path}.lock", "a")
    except OSError:  # a read-only folder: each process counts (and says why it cannot cache)
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read_cache(path: Path, reader_key: str) -> dict[str, ShardEntry]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("shard index %s is unreadable (%s): counting the shards again", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("version") != _VERSION or data.get("reader") != reader_key:
        return {}
    try:
        return {e["name"]: ShardEntry(e["name"], int(e["count"]), int(e["size"]), int(e["mtime_ns"]))
                for e in data["shards"]}
    except (KeyError, TypeError, ValueError):
        log.warning("shard index %s is malformed: counting the shards again", path)
        return {}


def _write_cache(path: Path, reader_key: str, entries: Sequence[ShardEntry]) -> None:
    payload = {"version": _VERSION, "reader": reader_key,
               "shards": [{"name": e.name, "count": e.count, "size": e.size, "mtime_ns": e.mtime_ns} for e in entries]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: loader workers and other ranks read it while a rank writes it.
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.info("shard index not cached (%s): %s; pass cache_dir= a writable folder to keep it", path, exc)
