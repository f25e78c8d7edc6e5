"""Data a job reads: sharded sources whose order survives any change of the world, and streams.

This room holds what sits between files and a ``DataLoader``; it imports nothing else
of ``elastic`` (torch and numpy only; pyarrow for Parquet, when installed). The API
(``elastic.ShardedSource``, ``elastic.SourceSampler``, ``elastic.StatefulStream``)
exports its names.

    order.py           the epoch's global order, batches, each rank's share: pure functions
    index.py           each shard's sample count, counted once and cached beside the data
    readers.py         token arrays (numpy.memmap), JSON lines, Parquet row groups, your own
    source.py          ShardedSource: the shards as one map-style data set, by global id
    source_sampler.py  SourceSampler: the cursor, committed; each step's global batch
    stream.py          StatefulStream: an opaque stream, resumed at the same world size
"""

from .index import ShardIndex
from .order import EpochOrder, OrderSettings
from .readers import CallableReader, JsonLinesReader, ParquetReader, TokenReader
from .source import ShardedSource
from .source_sampler import SourceSampler
from .stream import StatefulStream

__all__ = ["CallableReader", "EpochOrder", "JsonLinesReader", "OrderSettings", "ParquetReader", "ShardIndex",
           "ShardedSource", "SourceSampler", "StatefulStream", "TokenReader"]
