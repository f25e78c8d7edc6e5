"""hvd.init() and the process queries in a world of one (no launcher)."""

from __future__ import annotations

import os

import pytest


@pytest.mark.parametrize("query", ["rank", "size", "local_rank", "local_size", "cross_rank", "cross_size"])
def test_queries_before_init_raise_horovods_value_error(uninitialized, query):
    with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)."):
        getattr(uninitialized, query)()


def test_a_world_of_one_after_init(hvd):
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_homogeneous()


def test_init_sets_the_launcher_variables_once(hvd):
    assert os.environ["HOROVOD_RANK"] == "0" and os.environ["HOROVOD_SIZE"] == "1"
    assert os.environ["HOROVOD_LOCAL_SIZE"] == "1" and os.environ["HOROVOD_CROSS_SIZE"] == "1"
    assert os.environ["HOROVOD_HOSTNAME"]


def test_shutdown_then_init_gives_the_same_rank(hvd):
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError):
        hvd.size()
    hvd.init()
    assert (hvd.rank(), hvd.size()) == (0, 1)


def test_hvd_elastic_is_reachable(hvd):
    assert hvd.elastic.__name__ == "elastic.horovod.elastic"
