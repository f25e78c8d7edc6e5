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
    elastic/data/       sharded data sources and streams: the order, the cursor, the readers

Imports run one way: the API -> worker -> contract; the API -> data; agent -> contract; cli -> agent;
all of them may use ``elastic.rendezvous`` and ``elastic.checkpoint`` (the repository's
top-level ``rendezvous/`` and ``checkpoint/`` folders), which import nothing else of
``elastic`` (checked by tests/test_layout.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

# The rooms ``elastic.rendezvous`` and ``elastic.checkpoint`` are the repository's top-level
# ``rendezvous/`` and ``checkpoint/`` folders (pyproject.toml's package-dir): a wheel holds them
# under ``elastic/``, an editable install maps them with setuptools' own finder, and a source tree
# (a job started from the checkout's root, ``PYTHONPATH=checkout``, a script beside ``elastic/``)
# reaches them through the finder below, which maps exactly those two names to the same folders.
# So this package imports the same way from all three, whatever the working directory, even where
# the checkout's ``elastic/`` shadows an installed wheel on sys.path. Not symlinks (every tool
# that walks ``elastic/`` would see the rooms twice) nor the checkout's root on ``__path__``
# (every top-level folder would become ``elastic.<folder>``).
_ROOMS = ("rendezvous", "checkpoint")
_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT = os.path.dirname(_HERE)


class _CheckoutRooms(importlib.abc.MetaPathFinder):
    """``elastic.rendezvous`` and ``elastic.checkpoint`` from the checkout's top-level folders."""

    def find_spec(self, fullname, path=None, target=None):
        room = fullname.partition(".")[2] if fullname.startswith(__name__ + ".") else ""
        if room not in _ROOMS:
            return None
        folder = os.path.join(_CHECKOUT, room)
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


if not os.path.isdir(os.path.join(_HERE, _ROOMS[0])) and os.path.isfile(
        os.path.join(_CHECKOUT, _ROOMS[0], "__init__.py")) and not any(
        type(finder).__name__ == _CheckoutRooms.__name__ for finder in sys.meta_path):
    sys.meta_path.append(_CheckoutRooms())

# Every name is imported on first use (PEP 562). The launcher, the agent and the
# `rendezvous`/`checkpoint` rooms (elastic.rendezvous, elastic.checkpoint) live in this
# namespace too, and importing any of them runs this file: an eager import of the API
# would cost every `elastic-run` start, agent and joiner the 1.4 s of importing torch.
_LAZY = {
    "ElasticError": ".contract.errors", "HostsUpdatedInterrupt": ".contract.errors",
    "ResetLimitExceeded": ".contract.errors",
    "accumulate": ".global_batch",
    "ElasticSampler": ".sampler",
    "ShardedSource": ".data", "SourceSampler": ".data", "StatefulStream": ".data",
    "ObjectState": ".state", "State": ".state", "TorchState": ".state",
    "run": ".worker.recovery",
    "report": ".worker.step_log",
    # FSDP2's modules take a second or more to import: only jobs that shard pay for them.
    "ShardedState": ".sharded", "HybridShardedState": ".sharded", "device_mesh": ".sharded",
}

__all__ = [
    "ElasticError", "ElasticSampler", "HostsUpdatedInterrupt", "HybridShardedState", "ObjectState",
    "ResetLimitExceeded", "ShardedSource", "ShardedState", "SourceSampler", "State", "StatefulStream",
    "TorchState", "accumulate", "device_mesh", "init", "local_rank", "rank", "report",
    "round", "run", "shutdown", "size",
]


def _lifecycle():
    from .worker import lifecycle

    return lifecycle


def init() -> None:
    """Join the job this worker was started for (a world of one without a launcher)."""
    _lifecycle().start()


def shutdown() -> None:
    """Leave the job's process group and stop this worker's runtime (the end of a script)."""
    _lifecycle().shutdown()


def rank() -> int:
    """This worker's rank in the current ring (it may change at every re-formation)."""
    return _session().position.rank


def size() -> int:
    """The number of workers in the current ring (the world size; it changes as workers come and go)."""
    return _session().position.world_size


def local_rank() -> int:
    """This worker's device slot on its host (`LOCAL_RANK`): fixed for the process's life, its GPU under CUDA."""
    return _session().position.local_rank


def round() -> int:  # noqa: A001 - mirrors the event field name
    """The number of the current round: one more at every re-formation of the ring."""
    return _session().round


def _session():
    """This process's session (``worker/session.py``): where this worker stands, even before
    its first ring (a joiner's rank is known from ``init()``)."""
    return _lifecycle().current()


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
