"""The environment a worker process starts with.

Two sets of variables: torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, ...), so scripts
written for torchrun run unmodified, and ours (``ELASTIC_WORKER_*``, from
``WorkerConfig``), which the elastic runtime reads. Plus the few settings that make
the backends behave on this host (socket interface, threads, NCCL error handling).
"""

from __future__ import annotations

import os
from typing import Mapping

from rendezvous import RoundPlan

from ..worker_config import WorkerConfig
from . import addressing


def worker_env(
    base: Mapping[str, str],
    *,
    plan: RoundPlan,
    worker_id: str,
    member_id: str,
    master: tuple[str, int],
    worker_config: WorkerConfig,
    nproc_per_node: int,
    socket_ifname,
    restart_count: int,
) -> dict[str, str]:
    rank = plan.rank_of(worker_id)
    local = plan.local_ranks(member_id)
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local.index(worker_id)),
        WORLD_SIZE=str(plan.world_size),
        LOCAL_WORLD_SIZE=str(len(local)),
        GROUP_RANK=str(plan.member_order().index(member_id)),
        # MASTER_ADDR:PORT is for torchrun scripts only (the elastic runtime uses the
        # plan's store): a fresh store per round, so no stale peer addresses.
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
        TORCHELASTIC_RUN_ID=worker_config.job_id,
        # As under torchrun: env:// connects to the agent's store as a client (rank 0
        # must not start a second server on that port); every round has a fresh store.
        TORCHELASTIC_USE_AGENT_STORE="True",
        # torchrun's meaning: worker-group restarts after failures so far (0 at the
        # first start; membership changes do not count), not the round number.
        TORCHELASTIC_RESTART_COUNT=str(restart_count),
    )
    # Peers reach gloo/NCCL at the interface holding --host-addr, not at whatever
    # the host name resolves to; the user's own *_SOCKET_IFNAME win.
    env.update(addressing.socket_ifname_env(socket_ifname, worker_config.backend, env))
    if nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    if worker_config.backend == "nccl":
        # A failed NCCL collective raises instead of hanging; the ring is then aborted.
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.update(worker_config.to_env())
    env["ELASTIC_WORKER_AGENT_PID"] = str(os.getpid())
    return env
