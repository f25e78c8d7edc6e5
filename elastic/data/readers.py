"""Readers of one shard each: how many samples it holds, and samples by their offset in it.

A reader is what a ``ShardedSource`` asks of a file (or of any shard object of yours):

* ``count(shard) -> int``: the number of samples (once per shard: the index caches it);
* ``read(shard, offsets) -> list``: the samples at those offsets, in that order;
* ``key``: a string that says how the reader cuts a file into samples (the index keeps
  one cache per key: token files read with another sequence length are counted anew).

Readers are handed to loader worker processes by pickling: open files, memory maps and
cached row groups belong to one process and are dropped from the pickle (each worker
opens its own on first use).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch


class OpenShards(OrderedDict):
    """The shards a process has open, the least recently used dropped past ``limit``: a
    line-offset index or a row group is memory, and a window reads a few shards at a time."""

    def __init__(self, limit: int = 8):
        super().__init__()
        self.limit = limit

    def get(self, key, default=None):
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class _PerProcess:
    """Open handles kept per process; never pickled (a loader worker opens its own)."""

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_open"] = OpenShards(self._open.limit)
        return state


@dataclass(eq=False)
class TokenReader(_PerProcess):
    """Fixed-length samples of a flat token file (``numpy.memmap``): sample ``i`` of a shard
    is tokens ``[i * seq_len, (i + 1) * seq_len)``, as an int64 tensor; a tail shorter than
    ``seq_len`` is not a sample. ``header_bytes`` are skipped at the start of each file."""

    seq_len: int
    dtype: str = "uint16"
    header_bytes: int = 0
    _open: dict = field(default_factory=lambda: OpenShards(256), repr=False)

    def __post_init__(self):
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"TokenReader: seq_len must be an integer >= 1, got {self.seq_len!r}")
        self._itemsize = np.dtype(self.dtype).itemsize

    @property
    def key(self) -> str:
        return f"tokens:{np.dtype(self.dtype).str}:{self.seq_len}:{self.header_bytes}"

    def count(self, shard: str) -> int:
        return max(0, os.path.getsize(shard) - self.header_bytes) // self._itemsize // self.seq_len

    def tokens(self, shard: str) -> np.ndarray:
        tokens = self._open.get(shard)
        if tokens is None:
            length = self.count(shard) * self.seq_len
            # A plain ndarray over the map: slicing a np.memmap costs a subclass view per sample.
            tokens = np.memmap(shard, dtype=self.dtype, mode="r", offset=self.header_bytes,
                               shape=(length,)).view(np.ndarray) if length else np.zeros(0, dtype=self.dtype)
            self._open[shard] = tokens
        return tokens

    def read(self, shard: str, offsets: Sequence[int]) -> list:
        rows = self.tokens(shard).reshape(-1, self.seq_len)
        # One gather and one conversion for the shard's part of the batch; the rows are views of it.
        return list(torch.from_numpy(rows[np.asarray(offsets, dtype=np.int64)].astype(np.int64)))


@dataclass(eq=False)
class JsonLinesReader(_PerProcess):
    """One JSON value per line. The line-offset index of a shard (where each line starts)
    is built once per process, on its first read, from one pass over the memory-mapped
    file; empty lines are not samples."""

    _open: dict = field(default_factory=OpenShards, repr=False)

    key = "jsonl"

    def count(self, shard: str) -> int:
        return len(self._starts_ends(shard)[0])

    def _starts_ends(self, shard: str) -> tuple[np.ndarray, np.ndarray]:
        index = self._open.get(shard)
        if index is None:
            size = os.path.getsize(shard)
            data = np.memmap(shard, dtype=np.uint8, mode="r") if size else np.zeros(0, dtype=np.uint8)
            newlines = np.flatnonzero(data == ord("\n"))
            starts = np.concatenate([[0], newlines + 1]).astype(np.int64)
            ends = np.concatenate([newlines, [size]]).astype(np.int64)
            keep = ends > starts  # empty lines, and the empty tail after a final newline
            index = (starts[keep], ends[keep], data)
            self._open[shard] = index
        return index[0], index[1]

    def read(self, shard: str, offsets: Sequence[int]) -> list:
        starts, ends = self._starts_ends(shard)
        data = self._open[shard][2]
        return [json.loads(bytes(data[starts[o]:ends[o]])) for o in offsets]


@dataclass(eq=False)
class ParquetReader(_PerProcess):
    """Rows of Parquet files (``pyarrow``, the ``parquet`` extra), read by row group: a
    read loads the row groups its offsets fall in (the last one stays cached, so a
    window's reads seldom load a group twice) and gives each row as a dict."""

    columns: Optional[tuple[str, ...]] = None
    _open: dict = field(default_factory=OpenShards, repr=False)

    @property
    def key(self) -> str:
        return f"parquet:{','.join(self.columns) if self.columns else '*'}"

    @staticmethod
    def _pyarrow():
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("ParquetReader needs pyarrow: pip install pyarrow (in a checkout: pip install -e '.[parquet]')") from None
        return pq

    def _file(self, shard: str):
        opened = self._open.get(shard)
        if opened is None:
            pq = self._pyarrow()
            parquet = pq.ParquetFile(shard)
            sizes = [parquet.metadata.row_group(g).num_rows for g in range(parquet.metadata.num_row_groups)]
            opened = (parquet, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))
            self._open[shard] = opened
        return opened

    def count(self, shard: str) -> int:
        return int(self._pyarrow().ParquetFile(shard).metadata.num_rows)

    def read(self, shard: str, offsets: Sequence[int]) -> list:
        parquet, starts = self._file(shard)
        out: list = [None] * len(offsets)
        groups = np.searchsorted(starts, np.asarray(offsets, dtype=np.int64), side="right") - 1
        for group in sorted(set(groups.tolist())):
            rows = self._row_group(shard, parquet, group)
            for slot in np.flatnonzero(groups == group):
                out[slot] = rows[int(offsets[slot] - starts[group])]
        return out

    def _row_group(self, shard: str, parquet, group: int) -> list:
        cached = self._open.get(("group", shard))
        if cached is None or cached[0] != group:
            table = parquet.read_row_group(group, columns=list(self.columns) if self.columns else None)
            cached = (group, table.to_pylist())
            self._open[("group", shard)] = cached
        return cached[1]


@dataclass(eq=False)
class CallableReader:
    """A reader of your own from two functions: ``count(shard) -> int`` and
    ``read(shard, offsets) -> list`` (both must pickle, for loader workers: module-level
    functions, not lambdas); ``key`` names the way it cuts shards into samples."""

    count: Callable[[Any], int]
    read: Callable[[Any, Sequence[int]], list]
    key: str = "custom"
