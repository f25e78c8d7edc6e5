"""Elastic data-parallel training: the API user code writes against.

    import elastic
    elastic.init()
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @elastic.run
    def train(state): ...          # re-entered after every re-formation of the ring

The rooms of this package (each ``__init__.py`` says what it holds and may import):

    elastic/            this API: State and TorchState, ElasticSampler, the global batch
    elastic/worker/     the in-worker runtime: rounds, the recovery path, the state sync
    elastic/contract/   what a worker and its agent share: events, progress marks, config, errors
    elastic/agent/      the host side: one agent per host runs and watches its workers
    elastic/cli/        ``elastic-run`` and its subcommands (status, timeline, checkpoints)
    elastic/timeline/   what a job did, as a model and a picture
    elastic/horovod/    Horovod's PyTorch API on this runtime (``import elastic.horovod as hvd``)
    elastic/sharded/    ShardedState: FSDP2 models re-sharded in-process, shards kept on peers

Imports run one way: the API -> worker -> contract; agent -> contract; cli -> agent;
all of them may use ``rendezvous`` and ``checkpoint``, which import nothing of ``elastic``
(checked by tests/test_layout.py).
"""

from __future__ import annotations

from .contract.errors import ElasticError, HostsUpdatedInterrupt, ResetLimitExceeded
from .global_batch import accumulate
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState
from .worker import lifecycle
from .worker.recovery import run

__all__ = [
    "ElasticError", "ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "ResetLimitExceeded",
    "ShardedState", "State", "TorchState", "accumulate", "device_mesh", "init", "local_rank", "rank", "round", "run",
    "shutdown", "size",
]


def init() -> None:
    """Join the job this worker was started for (a world of one without a launcher)."""
    lifecycle.start()


def shutdown() -> None:
    lifecycle.shutdown()


def rank() -> int:
    return lifecycle.current().rank


def size() -> int:
    return lifecycle.current().world_size


def local_rank() -> int:
    return lifecycle.current().local_rank


def round() -> int:  # noqa: A001 - mirrors the event field name
    return lifecycle.current().round


def __getattr__(name: str):
    # FSDP2's modules take a second or more to import: only jobs that shard pay for them
    # (every worker imports this package, joiners and replacements on the recovery path).
    if name in ("ShardedState", "device_mesh"):
        from . import sharded

        return getattr(sharded, name)
    raise AttributeError(f"module 'elastic' has no attribute {name!r}")
