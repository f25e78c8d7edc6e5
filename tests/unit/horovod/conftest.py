"""A world of one for the Horovod API's unit tests: ``hvd.init()`` without a launcher.

The runtime (a gloo group of one) starts once per module and is shut down after it,
so no other test module finds it; each test gets Horovod freshly initialized."""

from __future__ import annotations

import pytest

from elastic.horovod import basics
from elastic.worker import lifecycle


@pytest.fixture(scope="module")
def world_of_one():
    lifecycle.start()
    yield
    basics.shutdown()
    lifecycle.shutdown()  # leaves no process group behind for the next module


@pytest.fixture
def hvd(world_of_one, monkeypatch):
    for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME"):
        monkeypatch.delenv("HOROVOD_" + name, raising=False)
    monkeypatch.setattr(basics, "_environment_set", False)
    import elastic.horovod

    elastic.horovod.init()
    yield elastic.horovod
    elastic.horovod.shutdown()


@pytest.fixture
def uninitialized():
    import elastic.horovod

    elastic.horovod.shutdown()
    return elastic.horovod
