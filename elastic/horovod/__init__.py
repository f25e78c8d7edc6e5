"""Horovod's PyTorch API on elastic-run: ``import elastic.horovod as hvd``.

A script written for ``import horovod.torch as hvd`` runs under ``elastic-run``
with that one line changed. This room (part of the API room) holds the Horovod
names, built on ``torch.distributed`` and this runtime; it may import the
``elastic`` API, the worker room (``elastic.worker``) and ``contract``, never the
agent or the CLI. ``elastic/horovod/elastic/`` is ``hvd.elastic``.
"""

from __future__ import annotations

from .basics import (
    cross_rank,
    cross_size,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

from . import elastic  # noqa: E402  (hvd.elastic)
