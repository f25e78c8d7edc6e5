"""DistributedOptimizer's decisions as tables: the bucket plan, the argument checks,
and the error a broken ring turns into (world of one, no ring needed)."""

from __future__ import annotations

import pytest
import torch

from elastic.horovod.common import HorovodInternalError
from elastic.horovod.ops import translated_errors
from elastic.horovod.optimizer import BucketPlan, bucket_bytes

F32, F64 = torch.float32, torch.float64


@pytest.mark.parametrize("sizes, dtypes, first, cap, buckets", [
    # reverse registration order; the first bucket small, the others up to the cap
    ([4, 4, 4, 4], [F32] * 4, 4, 8, ((3,), (2, 1), (0,))),
    ([4, 4, 4, 4], [F32] * 4, 100, 100, ((3, 2, 1, 0),)),
    # a dtype change always starts a new bucket
    ([4, 4, 4], [F32, F64, F32], 100, 100, ((2,), (1,), (0,))),
    # a parameter larger than the cap travels alone
    ([50, 1, 1], [F32] * 3, 2, 2, ((2, 1), (0,))),
    ([], [], 1, 1, ()),
])
def test_buckets_by_size(sizes, dtypes, first, cap, buckets):
    assert BucketPlan.by_size(sizes, dtypes, first, cap).buckets == buckets


@pytest.mark.parametrize("count, groups, buckets", [
    (4, [[0, 1]], ((3,), (2,), (1, 0))),
    (4, [[3, 0]], ((3, 0), (2,), (1,))),
    (5, BucketPlan.split_evenly(5, 2), ((4, 3), (2, 1, 0))),
    (3, BucketPlan.split_evenly(3, 7), ((2,), (1,), (0,))),
])
def test_buckets_by_groups(count, groups, buckets):
    assert BucketPlan.by_groups(count, groups).buckets == buckets


@pytest.mark.parametrize("environ, expected", [({}, 25 << 20), ({"HOROVOD_FUSION_THRESHOLD": "1048576"}, 1 << 20)])
def test_fusion_threshold_sets_the_bucket_size(environ, expected):
    assert bucket_bytes(environ) == expected


def test_a_ring_failure_becomes_horovod_internal_error_and_a_bug_does_not():
    with pytest.raises(HorovodInternalError) as info:
        with translated_errors():
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError) as info:
        with translated_errors():
            raise RuntimeError("shape mismatch: [3] vs [4]")
    assert not isinstance(info.value, HorovodInternalError)


def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))


@pytest.mark.parametrize("kwargs, error", [
    (dict(backward_passes_per_step=0), ValueError),
    (dict(op=1, gradient_predivide_factor=2.0), ValueError),  # Sum with a predivide factor
    (dict(op=2), NotImplementedError),  # Adasum
    (dict(groups="two"), ValueError),
    (dict(named=lambda m: [("same", p) for p in m.parameters()]), ValueError),
    (dict(named=lambda m: list(m.named_parameters())[:1]), ValueError),
    (dict(named=lambda m: list(m.parameters())), ValueError),
])
def test_optimizer_arguments_are_checked(hvd, kwargs, error):
    model = _model()
    named = kwargs.pop("named", None)
    with pytest.raises(error):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=named(model) if named else None, **kwargs)


def test_the_optimizer_is_the_wrapped_class_and_steps_alone(hvd):
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "Adam"
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        model(torch.ones(2, 3)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_load_state_dict_forgets_a_step_under_way(hvd):
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    saved = opt.state_dict()
    model(torch.ones(2, 3)).sum().backward()
    opt.load_state_dict(saved)  # an elastic restore between backward and step
    opt.zero_grad()  # allowed again: nothing is pending
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
