"""ShardedSource: readers (tokens, JSON lines, Parquet, your own), the cached index, loader workers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from elastic.data import ShardedSource, SourceSampler
from elastic.data.index import cache_path

SEQ = 8


def token_shards(folder, counts, seq=SEQ):
    """Shard k holds len counts[k] samples; sample with global id i is [i*1000, i*1000+1, ...] % 65536."""
    paths, first = [], 0
    for k, count in enumerate(counts):
        ids = np.arange(first, first + count, dtype=np.int64)[:, None]
        tokens = ((ids * 1000 + np.arange(seq)) % 65536).astype(np.uint16)
        path = folder / f"shard-{k:03d}.bin"
        tokens.tofile(path)
        paths.append(str(path))
        first += count
    return paths


def sample_of(sample_id, seq=SEQ):
    return ((sample_id * 1000 + np.arange(seq)) % 65536).astype(np.int64)


def test_token_shards_by_global_id(tmp_path):
    token_shards(tmp_path, [3, 0, 5])
    with open(tmp_path / "shard-000.bin", "ab") as f:
        f.write(b"\x01\x00" * 3)  # a tail shorter than a sample is no sample
    source = ShardedSource.tokens(str(tmp_path / "shard-*.bin"), seq_len=SEQ, with_ids=True)
    assert source.counts == [3, 0, 5] and len(source) == 8
    for sample_id in range(8):
        got_id, tokens = source[sample_id]
        assert got_id == sample_id and tokens.dtype == torch.int64
        assert tokens.tolist() == sample_of(sample_id).tolist()
    assert [i for i, _ in source.__getitems__([7, 0, 4, 3])] == [7, 0, 4, 3]  # the order asked for


def test_the_index_is_counted_once_cached_beside_the_data_and_verified(tmp_path, monkeypatch):
    paths = token_shards(tmp_path, [4, 4, 4])
    first = ShardedSource.tokens(paths, seq_len=SEQ)
    assert first.index.recounted == 3
    cache = cache_path(paths, first.reader.key)
    assert cache.parent == tmp_path and json.loads(cache.read_text())["reader"] == first.reader.key
    again = ShardedSource.tokens(paths, seq_len=SEQ)
    assert again.index.recounted == 0 and again.counts == [4, 4, 4]
    # A shard rewritten (another size and time) is counted again, the others are not.
    token_shards(tmp_path, [4, 6, 4])
    os.utime(paths[1], ns=(1, 1))
    changed = ShardedSource.tokens(paths, seq_len=SEQ)
    assert changed.counts[1] == 6 and changed.index.recounted >= 1 and changed.index.digest != again.index.digest
    # Another sample length is another index.
    assert ShardedSource.tokens(paths, seq_len=4).counts == [8, 12, 8]


def test_a_read_only_data_folder_keeps_the_index_elsewhere(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    paths = token_shards(data, [2, 2])
    cache = tmp_path / "job"
    source = ShardedSource.tokens(paths, seq_len=SEQ, cache_dir=str(cache))
    assert list(cache.glob(".elastic-index-*.json")) and not list(data.glob(".elastic-index-*"))
    assert source.counts == [2, 2]


def test_json_lines_with_a_line_offset_index(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"x": 0}\n{"x": 1}\n\n{"x": 2}')  # an empty line; no final newline
    (tmp_path / "b.jsonl").write_text('{"x": 3}\n')
    source = ShardedSource.json_lines(str(tmp_path / "*.jsonl"))
    assert source.counts == [3, 1]
    assert [source[i]["x"] for i in range(4)] == [0, 1, 2, 3]


def test_parquet_by_row_groups(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for k in range(2):
        table = pa.table({"id": list(range(k * 10, k * 10 + 10)), "text": [f"t{k}-{i}" for i in range(10)]})
        pq.write_table(table, tmp_path / f"p{k}.parquet", row_group_size=3)  # groups of 3, 3, 3, 1
    source = ShardedSource.parquet(str(tmp_path / "*.parquet"), columns=["id"])
    assert source.counts == [10, 10]
    assert [row["id"] for row in source.__getitems__([19, 0, 5, 9, 10])] == [19, 0, 5, 9, 10]
    assert source[4] == {"id": 4}


def count_lines(shard):
    with open(shard) as f:
        return sum(1 for _ in f)


def read_lines(shard, offsets):
    with open(shard) as f:
        lines = f.read().splitlines()
    return [lines[o].upper() for o in offsets]


def test_a_reader_of_your_own(tmp_path):
    (tmp_path / "a.txt").write_text("x\ny\n")
    (tmp_path / "b.txt").write_text("z\n")
    source = ShardedSource.custom(str(tmp_path / "*.txt"), count=count_lines, read=read_lines, key="lines")
    assert [source[i] for i in range(3)] == ["X", "Y", "Z"]
    with pytest.raises(TypeError, match="the reader object has no count"):
        ShardedSource([str(tmp_path / "a.txt")], reader=object())


def test_an_empty_share_collates_to_zero_rows(tmp_path):
    source = ShardedSource.tokens(token_shards(tmp_path, [3]), seq_len=SEQ, with_ids=True)
    ids, tokens = source.collate([])
    assert ids.shape == (0,) and tokens.shape == (0, SEQ)
    ids, tokens = source.collate(source.__getitems__([0, 2]))
    assert ids.tolist() == [0, 2] and tokens.shape == (2, SEQ)


def test_loader_workers_prefetch_without_consuming_and_keep_running_through_a_reset(tmp_path):
    paths = token_shards(tmp_path, [40] * 8)
    source = ShardedSource.tokens(paths, seq_len=SEQ, with_ids=True)
    sampler = SourceSampler(source, global_batch_size=12, seed=5, window=64)
    loader = DataLoader(source, batch_sampler=sampler, collate_fn=source.collate, num_workers=2,
                        prefetch_factor=4, persistent_workers=True)
    sampler.set_rank(1, 3)
    seen = []
    for step, (ids, tokens) in enumerate(loader):
        assert (tokens == torch.stack([torch.from_numpy(sample_of(i)) for i in ids.tolist()])).all()
        seen += ids.tolist()
        sampler.record_batch(step)
        if step == 2:
            break
    # Up to 8 batches were prefetched by then; only the 3 trained are consumed.
    assert sampler.state_dict()["cursor"] == 36
    workers = {w.pid for w in loader._iterator._workers}
    # A re-formation: the commit is restored and the world changes; the workers stay.
    sampler.load_state_dict(sampler.state_dict())
    sampler.set_rank(0, 2)
    ids, _ = next(iter(loader))
    assert {w.pid for w in loader._iterator._workers} == workers
    order = sampler.epoch_order().ids(0, len(source)).tolist()
    assert ids.tolist() == order[36:48][0::2]  # the next global batch, rank 0 of 2
    assert seen == [i for start in (0, 12, 24) for i in order[start:start + 12][1::3]]
    del loader


class SlowCounter:
    """A reader that records how many processes (here threads) count at once."""

    key = "slow"

    def __init__(self):
        self.counting, self.most, self.counted = 0, 0, 0
        self.lock = __import__("threading").Lock()

    def count(self, shard):
        with self.lock:
            self.counting += 1
            self.most = max(self.most, self.counting)
        __import__("time").sleep(0.02)
        with self.lock:
            self.counting -= 1
            self.counted += 1
        return 3

    def read(self, shard, offsets):
        return list(offsets)


def test_one_process_counts_the_others_read_its_cache(tmp_path):
    import threading

    paths = token_shards(tmp_path, [1] * 4)
    reader = SlowCounter()
    builds = [threading.Thread(target=ShardedSource, args=(paths, reader)) for _ in range(3)]
    for build in builds:
        build.start()
    for build in builds:
        build.join(30)
    assert reader.most == 1 and reader.counted == 4  # the first counted; the others found its cache


def test_a_reader_keeps_a_few_shards_open():
    from elastic.data.readers import OpenShards

    open_shards = OpenShards(limit=2)
    open_shards["a"], open_shards["b"] = 1, 2
    open_shards.get("a")  # used: "b" is now the least recently used
    open_shards["c"] = 3
    assert list(open_shards) == ["a", "c"]
