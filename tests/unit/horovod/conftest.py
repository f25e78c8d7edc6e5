"""A world of one for the Horovod API's unit tests: ``hvd.init()`` without a launcher."""

from __future__ import annotations

import pytest

from elastic.horovod import basics
from elastic.worker import lifecycle


@pytest.fixture
def hvd(monkeypatch):
    for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME"):
        monkeypatch.delenv("HOROVOD_" + name, raising=False)
    monkeypatch.setattr(basics, "_environment_set", False)
    import elastic.horovod

    elastic.horovod.init()
    yield elastic.horovod
    elastic.horovod.shutdown()
    lifecycle.shutdown()  # leaves no process group behind for the next test


@pytest.fixture
def uninitialized():
    import elastic.horovod

    elastic.horovod.shutdown()
    return elastic.horovod
