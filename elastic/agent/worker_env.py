"""The environment a worker process starts with.

Two sets of variables: torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, ...), so scripts
written for torchrun run unmodified, and ours (``ELASTIC_WORKER_*``, from
``WorkerConfig``), which the elastic runtime reads. Plus the few settings that make
the backends behave on this host (socket interface, threads, NCCL error handling).
"""

from __future__ import annotations

import os
from typing import Mapping

from elastic.rendezvous import RoundPlan

from ..contract.devices import uses_nccl
from ..contract.worker_config import INHERITED_SECRETS, PREFIX as WORKER_PREFIX, WorkerConfig
from . import addressing


def nccl_env(backend: str) -> dict[str, str]:
    """NCCL's settings for workers of ``backend`` (none without NCCL): the runtime's own
    timers and aborts decide when a ring is broken, never NCCL's watchdog."""
    if not uses_nccl(backend):
        return {}
    return {
        # 0 = no handling. 1 (tear down) and 3 (skip clean-up) make the watchdog SIGABRT the
        # whole process after a collective timeout or an asynchronous NCCL error: a slow step
        # on one rank, or a lost host, would kill every survivor instead of re-forming.
        # torch's _abort_process_group asks for 0 too: the runtime aborts the ring itself.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        # Before acting on a timeout the watchdog waits 4x this for a flight-recorder dump
        # (60 s by default); a second is enough for the dump and no stall.
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
        # 0: a sticky CUDA error seen by the watchdog ends its thread, not the process. With
        # 1 it SIGABRTs within 100 ms, before the main thread's next sync raises the error
        # for the classifier: a device-side assert (the user's bug) would count as a crash,
        # and every replacement would meet it again until --max-restarts (gpu review G10).
        # The main thread still raises it: a user error for an assert, a broken process
        # (WORKER_BROKEN, replaced) for an Xid or an ECC error (failures.py).
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
        # NVLink SHARP buffers are not given back when a communicator is aborted; rings
        # re-formed in-process would leak them (NVIDIA's in-process restart sets 0 too).
        "NCCL_NVLS_ENABLE": "0",
        # Any timeout seen by a watchdog writes "exception_dump" into the job's store, never
        # deleted; with dumps on, every later process's first NCCL group (a replacement, a
        # joiner) reads it and SIGABRTs itself after TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, and a
        # group that dumped blocks its destructor as long (gpu review G2).
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        # The heartbeat monitor, once it broke out of its loop (a dump requested, a stuck
        # watchdog), sleeps this long before it ends the process, and a group's destructor
        # joins it: 480 s by default, past the abort's 60 s deadline, so a group dropped in
        # leave_aborted made its worker exit broken, and a worker's exit hung for 8 min. Under
        # the deadline the destructor returns in time (gpu review G2); a watchdog stuck in a
        # driver call this long ends its process sooner, which its agent replaces anyway.
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "30",
        # A collective issued while a non-blocking communicator still forms holds its lock
        # for up to this long (30 min unset), and an abort needs that lock: keep it under
        # the abort's deadline (nccl_abort.ABORT_DEADLINE_S, 60 s), so the waiting collective
        # raises first (a ring failure) and the abort goes through (gpu review G5(b)). It
        # also bounds a healthy communicator's set-up: 30 s is ample at hundreds of ranks.
        "TORCH_NCCL_NONBLOCKING_TIMEOUT": "30",
    }


# What names one worker rather than the host (set by worker_env below): a worker forked
# from the template (warm_start.py) gets these from its own request; in anything else its
# environment must equal the template's.
PER_WORKER = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
})


def is_per_worker(name: str) -> bool:
    return name in PER_WORKER or name.startswith(WORKER_PREFIX)


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
    max_restarts: int,
    device_slot: int,
) -> dict[str, str]:
    rank = plan.rank_of(worker_id)
    local = plan.local_ranks(member_id)
    members = plan.member_order()
    env = {k: v for k, v in base.items() if k not in INHERITED_SECRETS}  # the password goes by a 0600 file
    env.update(
        RANK=str(rank),
        # The worker's device slot (device_slots.py): its GPU for the life of the process,
        # so it may exceed LOCAL_WORLD_SIZE once a worker of this host is gone.
        LOCAL_RANK=str(device_slot),
        WORLD_SIZE=str(plan.world_size),
        # This host's workers in the round (torchrun: --nproc-per-node; here fewer once
        # crashed workers are not replaced).
        LOCAL_WORLD_SIZE=str(len(local)),
        # torchrun's "group" is one agent's workers: its rank among the round's agents,
        # and how many agents the round has.
        GROUP_RANK=str(members.index(member_id)),
        GROUP_WORLD_SIZE=str(len(members)),
        # torchrun's roles (--role, "default") split the workers into kinds; we have one
        # kind, so a worker's role rank and role world are its global ones.
        ROLE_NAME="default",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(plan.world_size),
        # MASTER_ADDR:PORT is for torchrun scripts only (the elastic runtime uses the
        # plan's store): a fresh store per round, so no stale peer addresses.
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
        TORCHELASTIC_RUN_ID=worker_config.job_id,
        # As under torchrun: env:// connects to the agent's store as a client (rank 0
        # must not start a second server on that port); every round has a fresh store.
        TORCHELASTIC_USE_AGENT_STORE="True",
        # torchrun sets RESTART_COUNT to max_restarts - remaining_restarts: the part of
        # its agent's restart budget spent on failures so far, so 0 <= RESTART_COUNT <=
        # MAX_RESTARTS. Ours means the same for this host's agent: the part of
        # --max-restarts it has spent, on crashed workers it replaced and on rounds in
        # which its torchrun-style workers failed (each round once). Workers restarted
        # only because the membership changed (a host joined or left, or a peer was lost
        # elsewhere before ours failed) add nothing, as torchrun's agents re-rendezvous
        # for a new node without spending a restart. Per host like torchrun's, so hosts
        # may differ; not the round number.
        TORCHELASTIC_RESTART_COUNT=str(restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
    )
    # Peers reach gloo/NCCL at the interface holding --host-addr, not at whatever
    # the host name resolves to; the user's own *_SOCKET_IFNAME win.
    env.update(addressing.socket_ifname_env(socket_ifname, worker_config.backend, env))
    if nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    for name, value in nccl_env(worker_config.backend).items():
        env.setdefault(name, value)  # the user's own settings win
    env.update(worker_config.to_env())
    env["ELASTIC_WORKER_AGENT_PID"] = str(os.getpid())
    return env
