"""What a re-shard exchanges besides the shards travels as checked plain data (security review, finding 1)."""

import pickle

import pytest
import torch

from elastic.contract.errors import PeerDataInvalid
from elastic.sharded import meta_wire
from elastic.sharded.modules import CommitMeta
from elastic.sharded.reshard_plan import TensorLayout
from elastic.worker import wire
from elastic.worker.sync_plan import CommitId


def _meta():
    return CommitMeta(CommitId(3, 17), 2, (TensorLayout("model.fc.weight", (4, 3), "float32"),
                                           TensorLayout("optim.fc.weight.exp_avg", (4, 3), "bfloat16")),
                      values={"epoch": 2}, sampler={"epoch": 2, "length": 10, "prefix": 4, "processed": []},
                      buffers={"bn.running_mean": torch.arange(3.0)},
                      groups=[{"lr": 0.1, "betas": (0.9, 0.99), "params": ["fc.weight"]}],
                      plain_state={"fc.weight": {"step": torch.tensor(5.0)}},
                      scheduler={"step_size": 3, "gamma": 0.5, "base_lrs": [0.1], "last_epoch": 4, "_last_lr": [0.05]})


def test_a_commit_meta_round_trips():
    back = meta_wire.decode_meta(meta_wire.encode_meta(_meta()), 0, current_round=4)
    meta = _meta()
    assert (back.commit, back.world, back.layout, back.values, back.sampler, back.groups, back.scheduler) == \
        (meta.commit, meta.world, meta.layout, meta.values, meta.sampler, meta.groups, meta.scheduler)
    assert torch.equal(back.buffers["bn.running_mean"], meta.buffers["bn.running_mean"])
    assert torch.equal(back.plain_state["fc.weight"]["step"], torch.tensor(5.0))
    assert meta_wire.decode_meta(meta_wire.encode_meta(None), 0, current_round=4) is None


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.mark.parametrize("body, words", [
    (pickle.dumps(Evil()), "not plain data"),
    (wire.dumps({"commit": [9, 1]}), "expected the fields"),
    (wire.dumps({**meta_wire._meta_plain(_meta()), "scheduler": [1]}, tensors=True), "scheduler must be a dict"),
])
def test_a_crafted_meta_is_refused(body, words):
    with pytest.raises(PeerDataInvalid, match=words):
        meta_wire.decode_meta(body, 1, current_round=4)


def test_a_meta_of_a_round_after_the_current_one_is_refused():
    with pytest.raises(PeerDataInvalid, match="impossible"):
        meta_wire.decode_meta(meta_wire.encode_meta(_meta()), 1, current_round=2)


def test_a_meta_with_an_unknown_dtype_is_refused():
    meta = _meta()
    meta.layout = (TensorLayout("model.x", (2,), "evil"),)
    with pytest.raises(PeerDataInvalid, match="unknown dtype"):
        meta_wire.decode_meta(meta_wire.encode_meta(meta), 1, current_round=4)


def _report(held=(), metas=(), pending=()):
    return wire.dumps([[list(t) for t in part] for part in (held, metas, pending)])


def test_a_report_round_trips_as_tuples():
    held, metas, pending = meta_wire.decode_report(_report([(3, 17, 2, 1)], [(3, 17, 2)], [(3, 18, 2, 0)]), 1, 4)
    assert (held, metas, pending) == ([(3, 17, 2, 1)], [(3, 17, 2)], [(3, 18, 2, 0)])


@pytest.mark.parametrize("body", [
    _report([(10 ** 6, 10 ** 6, 2, 0)]),  # the review's attacker: a commit of a future round
    _report([(3, 17, 2, 2)]),  # shard 2 of a world of 2
    _report([(3, 17, 0, 0)]),  # a world of none
    _report([(3, -1, 2, 0)]),
    _report([(3, 17, 2)]),  # three numbers where four belong
    pickle.dumps(([], [], [])),
])
def test_an_impossible_report_is_refused(body):
    with pytest.raises(PeerDataInvalid):
        meta_wire.decode_report(body, 1, current_round=4)
