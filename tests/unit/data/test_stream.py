"""Opaque streams in a state: Hugging Face datasets (streaming and map-style, local files) and
torchdata's StatefulDataLoader resume exactly at the same world size; another is refused."""

from __future__ import annotations

import os

import pytest
import torch

import elastic
from elastic.data import StatefulStream
from elastic.data.stream import position_to_take

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing is downloaded: the files are the test's
datasets = pytest.importorskip("datasets")
pytest.importorskip("pyarrow")
stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")


@pytest.fixture
def parquet_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = []
    for k in range(4):
        path = tmp_path / f"part-{k}.parquet"
        pq.write_table(pa.table({"id": list(range(k * 25, k * 25 + 25))}), path, row_group_size=10)
        files.append(str(path))
    return files


def hf_stream(files, cache):
    def make(rank, world):
        from datasets.distributed import split_dataset_by_node

        ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True, cache_dir=cache)
        return stateful_dataloader.StatefulDataLoader(split_dataset_by_node(ds, rank, world), batch_size=5,
                                                      num_workers=2)
    return make


def test_a_hugging_face_stream_resumes_exactly_after_a_rollback(ring, parquet_files, tmp_path):
    stream = StatefulStream(hf_stream(parquet_files, str(tmp_path / "hf")))
    state = elastic.TorchState(stream=stream, step=0)
    trained = []
    for batch in stream:
        trained += batch["id"].tolist()
        state.step += 1
        state.commit()
        if state.step == 4:
            break
    for batch, _ in zip(stream, range(2)):  # two more batches, never committed
        pass
    state.restore()  # the failure's rollback: the stream goes back to the commit
    trained += [i for batch in stream for i in batch["id"].tolist()]
    assert sorted(trained) == list(range(100))  # each id once, none skipped


def test_a_map_style_hugging_face_dataset_takes_the_elastic_sampler(ring, parquet_files, tmp_path):
    ds = datasets.load_dataset("parquet", data_files=parquet_files, split="train", cache_dir=str(tmp_path / "hf"))
    sampler = elastic.ElasticSampler(ds, seed=1)
    loader = torch.utils.data.DataLoader(ds.with_format("torch"), batch_sampler=sampler.batches(global_batch_size=8),
                                         num_workers=2)
    state = elastic.TorchState(sampler=sampler, step=0)
    seen = []
    for step, batch in enumerate(loader):
        seen += batch["id"].tolist()
        sampler.record_batch(step)
        state.commit()
    assert sorted(seen) == list(range(100))


def test_another_world_size_is_refused_in_one_line_before_a_batch_is_read():
    committed = {"world_size": 4, "states": [b"0", b"1", b"2", b"3"]}
    assert position_to_take(committed, 2, 4) == b"2"
    assert position_to_take({"world_size": 0, "states": []}, 0, 3) is None  # the stream's start
    with pytest.raises(ValueError, match="committed at world size 4, the ring now has 3") as refused:
        position_to_take(committed, 0, 3)
    assert "elastic.ShardedSource" in str(refused.value) and "\n" not in str(refused.value)
    built = []
    stream = StatefulStream(lambda rank, world: built.append((rank, world)) or [])
    stream.load_state_dict(committed)
    with pytest.raises(ValueError, match="committed at world size 4, the ring now has 1"):
        next(iter(stream))
    assert built == []  # nothing was built, nothing read


def test_a_bare_loader_in_a_state_is_refused_at_the_first_commit(ring):
    loader = stateful_dataloader.StatefulDataLoader(list(range(10)), batch_size=2)
    state = elastic.TorchState(loader=loader, step=0)
    with pytest.raises(TypeError, match="keyword 'loader' holds a StatefulDataLoader, whose state_dict.. is one "
                                        "rank's position: commit it as elastic.StatefulStream"):
        state.commit()


class Opaque:
    """A position that is not plain values: a resume would have to unpickle it."""


class StreamOfOpaquePositions:
    def __iter__(self):
        return iter([1, 2])

    def state_dict(self):
        return {"where": Opaque()}

    def load_state_dict(self, state):
        pass


def test_a_position_that_is_not_plain_values_is_refused_at_the_first_batch():
    stream = StatefulStream(lambda rank, world: StreamOfOpaquePositions())
    with pytest.raises(ValueError, match="StatefulStream: a position holds more than tensors and plain values") \
            as refused:
        next(iter(stream))
    assert "\n" not in str(refused.value)
