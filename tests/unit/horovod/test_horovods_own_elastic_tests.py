"""Horovod's own ``test/single/test_torch_elastic.py``, ported: its two tests' steps and
assertions, run on ``elastic.horovod`` in a world of one (as Horovod runs them without
``horovodrun``). Written anew here, in this project's style; the facts (what each step
asserts) are Horovod's.

The sampler test is the one that defines the repeat: after an epoch ends, iterating the
loader again without ``set_epoch`` yields the epoch's pass again (4 batches), and the
progress stays what it was.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset


class ListDataset(Dataset):
    def __init__(self, data):
        self.data = data

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return len(self.data)


def _linear(value_or_rows):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    if isinstance(value_or_rows, float):
        weight, bias = torch.full((2, 2), value_or_rows), torch.full((2,), value_or_rows)
    else:
        weight, bias = torch.tensor(value_or_rows), torch.zeros(2)
    model.load_state_dict({"0.weight": weight, "0.bias": bias})
    return model


def _weights(model):
    return [w.clone() for w in model.state_dict().values()]


def test_elastic_state_syncs_restores_and_commits(hvd):
    model = _linear(1.0 if hvd.rank() == 0 else 2.0)
    other = _linear([[1.0, 2.0], [3.0, 4.0]])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001 * hvd.size())
    state = hvd.elastic.TorchState(model, optimizer, batch=20 + hvd.rank(), epoch=10 + hvd.rank())
    state.sync()
    synced = _weights(model)
    assert all(torch.equal(w, torch.ones_like(w)) for w in model.state_dict().values())  # rank 0's
    assert (state.batch, state.epoch) == (20, 10)

    model.load_state_dict(other.state_dict())  # changed, then rolled back
    state.batch, state.epoch = 21, 11
    state.restore()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), synced))
    assert (state.batch, state.epoch) == (20, 10)

    model.load_state_dict(other.state_dict())  # changed, then committed
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), _weights(other)))
    assert (state.batch, state.epoch) == (21, 11)


def test_elastic_sampler_repeats_commits_restores_and_repartitions(hvd):
    batch_size, per_worker = 2, 8
    dataset = ListDataset(list(range(per_worker * hvd.size())))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    state = hvd.elastic.TorchState(sampler=sampler)
    state.sync()
    assert (state.sampler.epoch, state.sampler.processed_num) == (0, 0)

    batches = 0
    for epoch in range(2):  # plain use
        sampler.set_epoch(epoch)
        for batch_idx, _ in enumerate(loader):
            sampler.record_batch(batch_idx, batch_size)
            assert sampler.processed_num == batch_size * (batch_idx + 1)
            batches += 1
    assert batches == 2 * per_worker // batch_size

    # No set_epoch: the progress stays, and the loader repeats the epoch's pass.
    batches = 0
    for _ in loader:
        assert sampler.processed_num == len(sampler)
        batches += 1
    assert batches == per_worker // batch_size  # 4 (this was 0 before the repeat)

    sampler.set_epoch(2)  # a partial epoch, committed
    assert sampler.processed_num == 0
    sampler.record_batch(0, batch_size)
    sampler.record_batch(1, batch_size)
    assert sampler.processed_num == 2 * batch_size
    state.commit()

    sampler.record_batch(2, batch_size)  # more, rolled back
    sampler.record_batch(3, batch_size)
    assert sampler.processed_num == 4 * batch_size
    state.restore()
    assert sampler.processed_num == 2 * batch_size

    sampler.record_batch(2, batch_size)  # a sync re-partitions what is left
    assert sampler.processed_num == 3 * batch_size
    state.commit()
    state.sync()
    assert sampler.processed_num == 3 * batch_size * hvd.size()
    assert len(sampler) == batch_size
    assert sum(1 for _ in loader) == 1

    sampler.set_epoch(3)  # the next epoch starts afresh
    assert len(sampler) == per_worker
    assert sum(1 for _ in loader) == per_worker // batch_size
