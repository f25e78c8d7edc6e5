"""ShardedSource: a data set given as shards, read by global sample id (random access).

    source = ShardedSource.tokens("data/*.bin", seq_len=129)        # uint16 token files
    sampler = SourceSampler(source, global_batch_size=64, seed=0)
    loader = DataLoader(source, batch_sampler=sampler, collate_fn=source.collate,
                        num_workers=2, prefetch_factor=4, persistent_workers=True)

The source is a map-style ``Dataset`` over global sample ids: shard ``k``'s samples
have the ids that follow shard ``k - 1``'s (``index.py`` counts them). What is read
when, and by which rank, is the sampler's business (``source_sampler.py``); the source
only reads. A loader's worker gets a pickled copy and opens its own files.
"""

from __future__ import annotations

import glob
import os
from collections import defaultdict
from typing import Any, Optional, Sequence, Union

import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from .index import ShardIndex
from .order import first_ids, locate
from .readers import CallableReader, JsonLinesReader, ParquetReader, TokenReader

Shards = Union[str, os.PathLike, Sequence[Any]]


def shard_list(shards: Shards) -> list:
    """A glob pattern's files, sorted; or the shards as given."""
    if isinstance(shards, (str, os.PathLike)):
        found = sorted(glob.glob(os.fspath(shards)))
        if not found:
            raise FileNotFoundError(f"ShardedSource: no file matches {os.fspath(shards)!r}")
        return found
    found = list(shards)
    if not found:
        raise ValueError("ShardedSource: no shards given")
    return found


class ShardedSource(Dataset):
    """Shards with an index of their sample counts, read by global sample id.

    ``reader``: a ``TokenReader``, ``JsonLinesReader``, ``ParquetReader``, a
    ``CallableReader`` or any object with ``count``, ``read`` and ``key``
    (``readers.py``). ``cache_dir``: where the index's cache goes (default: beside the
    shards). ``with_ids``: each sample comes as ``(sample_id, sample)``, so a training
    loop can see what it trains.
    """

    def __init__(self, shards: Shards, reader, *, cache_dir: Optional[str] = None, with_ids: bool = False):
        for method in ("count", "read"):
            if not callable(getattr(reader, method, None)):
                raise TypeError(f"ShardedSource: the reader {type(reader).__name__} has no {method}() method")
        self.shards = shard_list(shards)
        self.reader = reader
        self.with_ids = bool(with_ids)
        self.index = ShardIndex.build(self.shards, reader, cache_dir)
        self.counts = self.index.counts
        self._first_ids = first_ids(self.counts)
        self._empty: Any = None  # a zero-row batch shaped like one sample's (collate)

    # -- the formats ------------------------------------------------------------
    @classmethod
    def tokens(cls, shards: Shards, seq_len: int, dtype: str = "uint16", header_bytes: int = 0,
               **kwargs) -> "ShardedSource":
        """Flat token files, ``seq_len`` tokens per sample (``numpy.memmap``)."""
        return cls(shards, TokenReader(seq_len, dtype, header_bytes), **kwargs)

    @classmethod
    def json_lines(cls, shards: Shards, **kwargs) -> "ShardedSource":
        """JSON-lines files, one sample per non-empty line."""
        return cls(shards, JsonLinesReader(), **kwargs)

    @classmethod
    def parquet(cls, shards: Shards, columns: Optional[Sequence[str]] = None, **kwargs) -> "ShardedSource":
        """Parquet files, one sample (a dict) per row; needs pyarrow."""
        return cls(shards, ParquetReader(tuple(columns) if columns else None), **kwargs)

    @classmethod
    def custom(cls, shards: Shards, count, read, key: str = "custom", **kwargs) -> "ShardedSource":
        """Your own format: ``count(shard) -> int`` and ``read(shard, offsets) -> list``."""
        return cls(shards, CallableReader(count, read, key), **kwargs)

    # -- Dataset ------------------------------------------------------------------
    def __len__(self) -> int:
        return self.index.total

    def __getitem__(self, sample_id: int):
        return self.__getitems__([sample_id])[0]

    def __getitems__(self, sample_ids: Sequence[int]) -> list:
        """Samples by global id, each shard read once per call, offsets in ascending order."""
        by_shard: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for slot, sample_id in enumerate(sample_ids):
            shard, offset = locate(self.counts, int(sample_id), self._first_ids)
            by_shard[shard].append((offset, slot))
        out: list = [None] * len(sample_ids)
        for shard, wanted in by_shard.items():
            wanted.sort()
            samples = self.reader.read(self.shards[shard], [offset for offset, _ in wanted])
            if len(samples) != len(wanted):
                raise ValueError(f"the reader gave {len(samples)} samples of shard {self.shards[shard]} "
                                 f"for {len(wanted)} offsets")
            for (_, slot), sample in zip(wanted, samples):
                out[slot] = (int(sample_ids[slot]), sample) if self.with_ids else sample
        return out

    def collate(self, samples: list):
        """``default_collate``, and an empty batch (zero rows, one sample's shape) for an empty
        share: the last global batch of an epoch can hold fewer samples than there are ranks,
        and every rank must still run the step (DDP's all-reduce needs them all)."""
        if samples:
            return default_collate(samples)
        if self._empty is None:
            one = default_collate(self.__getitems__([0]) if len(self) else [])
            self._empty = _zero_rows(one)
        return self._empty


def _zero_rows(batch):
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {key: _zero_rows(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        if all(isinstance(value, str) for value in batch):  # a batch of strings: its rows
            return type(batch)()
        return type(batch)(_zero_rows(value) for value in batch)  # the fields of a tuple sample
    return batch
