"""The GPU tests (gpu review section 3): `make test-gpu`, on a machine with CUDA.

Every test here carries the ``gpu`` marker; each file skips itself, with the reason,
where CUDA (or a second GPU, or an etcd binary) is missing, so the CPU CI collects them
and runs none. Anything that sets ``TORCH_NCCL_*`` runs in a child process: the
variables are read when a process group is made, and tear-down mode kills the process.
"""

from __future__ import annotations

import pytest
import torch

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU and a CUDA build of torch)")
NEEDS_TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs two GPUs (a peer of an NCCL ring on another device)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; run with `make test-gpu`")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)


def etcd_binary_or_skip() -> str:
    """An etcd server binary found the way tests/conftest.py finds one (a lent GPU
    machine may have none: then the test says so and skips)."""
    from elastic.rendezvous.embedded import find_etcd_binary
    from elastic.rendezvous.errors import RendezvousError

    try:
        return find_etcd_binary()
    except RendezvousError as exc:
        pytest.skip(f"needs an etcd server binary: {exc}")
