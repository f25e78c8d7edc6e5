"""Horovod's PyTorch API on elastic-run: ``import elastic.horovod as hvd``.

A script written for ``import horovod.torch as hvd`` runs under ``elastic-run``
with that one line changed. This room (part of the API room) holds the Horovod
names, built on ``torch.distributed`` and this runtime; it may import the
``elastic`` API, the worker room (``elastic.worker``) and ``contract``, never the
agent or the CLI. ``elastic/horovod/elastic/`` is ``hvd.elastic``.

Supported as in Horovod: init/shutdown/is_initialized, rank/size/local_*/cross_*,
is_homogeneous, the build queries (gloo built and enabled, no MPI, ``nccl_built()``
torch's NCCL version code or 0), the ops Average Sum Min Max Product,
allreduce[_][_async][_] and grouped_*, allgather (dim 0 may differ), broadcast[_],
alltoall (with splits it returns ``(output, received_splits)``), reducescatter
(default Average), barrier, broadcast_object, allgather_object, synchronize, poll,
Compression.none/fp16, autograd through allreduce/allgather/broadcast/alltoall,
broadcast_parameters, broadcast_optimizer_state, DistributedOptimizer,
HorovodInternalError (a torch DistError: the runtime re-forms the ring on it).

Differences from Horovod:
- Collectives are matched by issue order (torch.distributed), not negotiated by
  name: every rank must issue the same collectives in the same order (names are
  accepted and ignored). DistributedOptimizer keeps one canonical order itself.
- Adasum, process sets other than the global one, ``hvd.join``, ``init(comm=...)``,
  ``SyncBatchNorm`` and Horovod's timeline raise NotImplementedError with one line.
- Sparse gradients are all-reduced dense (as with ``sparse_as_dense=True``).
- DistributedOptimizer buckets gradients like DDP (1 MB first, then 25 MB;
  ``HOROVOD_FUSION_THRESHOLD`` in bytes sets the size) instead of Horovod's
  fusion cycles; ``groups=`` makes explicit buckets. It registers its hooks at
  every size (a world of one can grow) and needs no collective at construction.
- ``hvd.shutdown()`` only marks Horovod uninitialized; the worker stays in the ring
  until it exits, and ``hvd.init()`` afterwards gives the same rank and size.
- ``HOROVOD_RANK`` etc. are set at the first ``init()`` if unset and, as under
  Horovod's elastic launcher, keep the start assignment after re-formations.
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
from .common import (
    Adasum,
    Average,
    Compression,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    SyncBatchNorm,
    add_process_set,
    ccl_built,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    remove_process_set,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from .functions import broadcast_optimizer_state, broadcast_parameters
from .gather_ops import (
    allgather,
    allgather_async,
    allgather_object,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    join,
    reducescatter,
    reducescatter_async,
)
from .ops import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    synchronize,
)
from .optimizer import DistributedOptimizer

from . import elastic  # noqa: E402  (hvd.elastic)
