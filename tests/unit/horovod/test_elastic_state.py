"""hvd.elastic in a world of one: TorchState's handled values, swaps, check_host_updates,
reset callbacks, and ElasticSampler's Horovod interface and layout."""

from __future__ import annotations

import pytest
import torch

from elastic.contract.errors import HostsUpdatedInterrupt
from elastic.worker import lifecycle


def sgd_step(model, optimizer):
    optimizer.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()


def test_any_number_of_models_optimizers_and_samplers_commit_and_restore(hvd):
    torch.manual_seed(0)
    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train, val = hvd.elastic.ElasticSampler(list(range(10))), hvd.elastic.ElasticSampler(list(range(6)), shuffle=False)
    state = hvd.elastic.TorchState(model, optimizer, head=other, train_sampler=train, val_sampler=val, epoch=3)
    state.sync()
    sgd_step(model, optimizer)
    train.record_batch(0, 4)
    state.epoch = 4
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    head = other.weight.detach().clone()

    sgd_step(model, optimizer)
    with torch.no_grad():
        other.weight.add_(1.0)
    train.record_batch(1, 4)
    val.record_batch(0, 2)
    state.epoch = 5
    state.restore()

    assert state.epoch == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in committed.items())
    assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"], momentum)
    assert torch.equal(other.weight, head)
    assert (train.processed_num, val.processed_num) == (4, 0)
    assert state.model is model and state.optimizer is optimizer and state.train_sampler is train


def test_assigning_a_handled_value_swaps_it_and_saves_at_once(hvd):
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    state = hvd.elastic.TorchState(first, batch=0)
    state.sync()
    state.commit()
    state.model = second  # saved now: a rollback keeps the new model's weights
    weights = second.weight.detach().clone()
    with torch.no_grad():
        second.weight.add_(1.0)
    state.restore()
    assert state.model is second
    assert torch.equal(second.weight, weights)
    with pytest.raises(TypeError, match="holds a model"):
        state.model = 3


def test_optimizer_and_model_may_be_left_out(hvd):
    sampler = hvd.elastic.ElasticSampler(list(range(8)))
    state = hvd.elastic.TorchState(sampler=sampler)
    assert state.model is None and state.optimizer is None
    state.sync()
    assert state.sampler.epoch == 0 and state.sampler.processed_num == 0


def test_check_host_updates_commits_then_raises_when_the_ring_is_about_to_change(hvd, monkeypatch):
    model = torch.nn.Linear(3, 2)
    state = hvd.elastic.TorchState(model, batch=0)
    state.sync()
    state.check_host_updates()  # nothing pending: nothing happens
    assert state.commit_id.count == 0

    monkeypatch.setattr(lifecycle.ring(), "ring_change_ready", lambda: True)
    state.batch = 7
    with torch.no_grad():
        model.weight.add_(1.0)
    weights = model.weight.detach().clone()
    with pytest.raises(HostsUpdatedInterrupt):
        state.check_host_updates()
    assert state.commit_id.count == 1  # the change is taken at a commit: nothing is rolled back
    state.restore()
    assert state.batch == 7 and torch.equal(model.weight, weights)


def test_reset_callbacks_run_after_a_reset_not_at_the_jobs_start(hvd):
    calls = []
    state = hvd.elastic.ObjectState(epoch=0)
    state.register_reset_callbacks([lambda: calls.append(state.epoch)])
    state.sync()
    state.on_reset(lifecycle.ring())  # the first entry of the job's first ring: no reset happened
    assert calls == []
    state.epoch = 4
    state.on_reset(lifecycle.ring())  # every later entry follows a re-formation (elastic.run calls it after the sync)
    assert calls == [4]


def test_run_does_nothing_at_decoration_time(uninitialized):
    lifecycle.shutdown()

    @uninitialized.elastic.run
    def train(state):
        return 1

    assert train.__name__ == "train"  # no runtime was needed to decorate


# -- ElasticSampler -----------------------------------------------------------------


def test_sampler_pads_and_strides_like_horovod_and_records_the_next_global_batch(hvd):
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    sampler.set_rank(1, 4)
    assert len(sampler) == 3  # ceil(10 / 4): every rank the same count
    assert list(sampler) == [1, 5, 9]
    sampler.set_rank(3, 4)
    assert list(sampler) == [3, 7, 1]  # the wrap-around padding
    sampler.record_batch(0, 2)  # batch_idx is ignored: the next 2 * 4 positions
    assert sampler.processed_num == 8
    sampler.record_batch(5, 2)  # the padded tail: only 2 real samples more
    assert sampler.processed_num == 10
    sampler.set_rank(0, 3)  # a re-formation: the rest of the epoch is empty, nothing repeats
    assert list(sampler) == [] and len(sampler) == 0


def test_sampler_repartitions_only_the_unprocessed_indices(hvd):
    sampler = hvd.elastic.ElasticSampler(list(range(12)), seed=5)
    shares = []
    for rank in range(3):
        sampler.set_rank(rank, 3)
        shares.append(list(sampler))
    sampler.record_batch(0, 2)  # one step of 2 samples per rank
    done = {i for share in shares for i in share[:2]}
    assert sampler.processed_num == 6
    rest = []
    for rank in range(2):  # a worker was lost
        sampler.set_rank(rank, 2)
        rest.extend(sampler)
    assert sorted(rest + sorted(done)) == list(range(12))


def test_set_epoch_keeps_the_current_epochs_progress_and_clears_another(hvd):
    sampler = hvd.elastic.ElasticSampler(list(range(8)))
    sampler.record_batch(0, 3)
    sampler.set_epoch(0)
    assert sampler.processed_num == 3
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.processed_num, len(sampler)) == (1, 0, 8)


def test_sampler_state_round_trips_and_accepts_horovods_form(hvd):
    sampler = hvd.elastic.ElasticSampler(list(range(8)), seed=2)
    sampler.record_batch(0, 3)
    copy = hvd.elastic.ElasticSampler(list(range(8)), seed=2)
    copy.load_state_dict(sampler.state_dict())
    # The copy's pass starts at its load; the original's is the pass since its last reset,
    # which it repeats (Horovod's semantics): the copy yields that pass's unrecorded rest.
    assert list(copy) == list(sampler)[3:] and copy.processed_num == 3
    copy.load_state_dict({"epoch": 2, "processed_num": 5})
    assert (copy.epoch, copy.processed_num, len(copy)) == (2, 5, 3)


def test_sampler_repeats_its_pass_until_a_reset_and_counts_each_sample_once(hvd):
    sampler = hvd.elastic.ElasticSampler(list(range(6)), shuffle=False)
    first = list(sampler)
    sampler.record_batch(0, 2)  # two samples trained, then the loop breaks out and iterates again
    assert list(sampler) == first == list(range(6))  # Horovod's repeat: the pass since the last reset
    sampler.record_batch(0, 4)  # the repeat's first 4: two of them again, counted once
    assert sampler.processed_num == 4
    sampler.set_rank(0, 1)  # a reset (a re-formation): the pass is what is left
    assert list(sampler) == [4, 5]


def test_sampler_refuses_other_settings_and_still_loads_horovods_form(hvd):
    sampler = hvd.elastic.ElasticSampler(list(range(8)), seed=2)
    sampler.record_batch(0, 3)
    with pytest.raises(ValueError, match="seed committed as 2, now 3"):
        hvd.elastic.ElasticSampler(list(range(8)), seed=3).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="shuffle committed as True, now False"):
        hvd.elastic.ElasticSampler(list(range(8)), seed=2, shuffle=False).load_state_dict(sampler.state_dict())
    other = hvd.elastic.ElasticSampler(list(range(8)), seed=3)
    other.load_state_dict({"epoch": 0, "processed_num": 3})  # Horovod's own form carries no settings
    assert other.processed_num == 3
