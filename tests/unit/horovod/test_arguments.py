"""The Horovod API's argument checks and constants, in a world of one (no ring needed)."""

from __future__ import annotations

import pytest
import torch

from elastic.contract.faults import RING
from elastic.worker.failures import classify


def test_build_queries_say_gloo_without_mpi(hvd):
    assert hvd.gloo_built() and hvd.gloo_enabled()
    assert not hvd.mpi_built() and not hvd.mpi_enabled()
    assert not hvd.ddl_built() and not hvd.ccl_built()
    assert isinstance(hvd.nccl_built(), int)
    assert isinstance(hvd.cuda_built(), bool) and isinstance(hvd.rocm_built(), bool)
    with pytest.raises(ValueError):
        hvd.mpi_threads_supported()


def test_the_ops_are_distinct_ints(hvd):
    ops = [hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product]
    assert len(set(ops)) == 6 and all(isinstance(op, int) for op in ops)


def test_a_broken_ring_error_is_a_communication_error_to_the_runtime(hvd):
    error = hvd.HorovodInternalError("peer gone")
    assert isinstance(error, RuntimeError)
    assert classify(error).kind == RING


def test_average_and_op_together_are_refused(hvd):
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)


def test_the_deprecated_average_flag_still_picks_sum_or_average(hvd):
    with pytest.warns(DeprecationWarning):
        assert torch.equal(hvd.allreduce(torch.full((2,), 3.0), average=False), torch.full((2,), 3.0))


def test_adasum_is_refused_with_one_line(hvd):
    with pytest.raises(NotImplementedError, match="Adasum") as info:
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    assert "\n" not in str(info.value)


def test_process_sets_other_than_the_global_one_are_refused(hvd):
    assert hvd.global_process_set.included()
    assert (hvd.global_process_set.rank(), hvd.global_process_set.size()) == (0, 1)
    with pytest.raises(NotImplementedError):
        hvd.ProcessSet([0])
    with pytest.raises(NotImplementedError):
        hvd.allreduce(torch.ones(1), process_set=object())


def test_join_is_refused(hvd):
    with pytest.raises(NotImplementedError, match="join"):
        hvd.join()


def test_alltoall_splits_must_cover_dim_zero(hvd):
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(torch.ones(3), splits=[2])


def test_broadcast_root_must_be_a_rank(hvd):
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(torch.ones(1), root_rank=1)


def test_in_place_ops_need_contiguous_tensors(hvd):
    with pytest.raises(ValueError, match="contiguous"):
        hvd.allreduce_(torch.ones(4, 4).t())


def test_fp16_compression_travels_as_half_and_returns_the_dtype(hvd):
    tensor = torch.tensor([1.5, 2.25], dtype=torch.float64)
    compressed, ctx = hvd.Compression.fp16.compress(tensor)
    assert compressed.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(compressed, ctx).dtype == torch.float64
    integers = torch.tensor([1, 2])
    assert hvd.Compression.fp16.compress(integers)[0].dtype == torch.int64
    assert hvd.allreduce(tensor, compression=hvd.Compression.fp16).dtype == torch.float64


def test_an_unknown_handle_synchronizes_to_none(hvd):
    assert hvd.synchronize(123456) is None
