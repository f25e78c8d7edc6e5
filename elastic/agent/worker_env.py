"""The environment a worker process starts with.

Two sets of variables: torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, ...), so scripts
written for torchrun run unmodified, and ours (``ELASTIC_WORKER_*``, from
``WorkerConfig``), which the elastic runtime reads. Plus the few settings that make
the backends behave on this host (socket interface, threads, NCCL error handling).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from elastic.rendezvous import RoundPlan

from ..contract.devices import uses_nccl
from ..contract.worker_config import INHERITED_SECRETS, PREFIX as WORKER_PREFIX, WorkerConfig
from . import addressing

log = logging.getLogger(__name__)

NONBLOCKING_VAR = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
HEARTBEAT_VAR = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
# nccl_abort.ABORT_DEADLINE_S: the agent cannot import it (nccl_abort imports torch, 1.4 s
# at every start); tests/unit/agent/test_worker_env.py keeps the two equal.
WORKER_ABORT_DEADLINE_S = 150
# TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, in seconds (see nccl_env): the heartbeat monitor may
# wait for two dumps before it sleeps out the heartbeat.
DUMP_WAIT_S = 1
# What a dropped group's destructor may take on top of the heartbeat monitor's sleep and
# still leave the abort itself time under its deadline (leave_aborted).
ABORT_ROOM_S = 10
# A healthy communicator forms within the non-blocking wait, or its first collective raises
# and the ring re-forms, to meet the same wait every round. 30 s is ample at hundreds of
# ranks (gpu review G5(b)), but set-up grows with the world (N6): 15 s more for each
# doubling past 1024 ranks, an allowance, not a measurement at scale (torch forms large
# communicators from several roots, TORCH_NCCL_RANKS_PER_ROOT: leave it on). Capped so
# that the heartbeat above it fits under the abort deadline (65536 ranks reach the cap).
NONBLOCKING_BASE_S = 30
NONBLOCKING_BASE_RANKS = 1024
NONBLOCKING_PER_DOUBLING_S = 15
NONBLOCKING_CAP_S = 120
# The heartbeat sits this far above the non-blocking wait (gpu review N5: 45-50 s at the
# 30 s wait). A watchdog waiting for the lock that a collective holds through that wait is
# stalled, not stuck, and a SIGABRT would count as a crash; the margin covers its work once
# it has the lock, and the other stalls of an abort (a cudaFree behind a kernel still spinning).
HEARTBEAT_ABOVE_NONBLOCKING_S = 15


@dataclass(frozen=True)
class NcclWaits:
    """The two NCCL waits a worker starts with, in seconds, and which of them the user set
    (``TORCH_NCCL_NONBLOCKING_TIMEOUT``, ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``). The order
    they must keep: non-blocking wait < heartbeat < abort deadline (``out_of_order``)."""

    nonblocking_s: int
    heartbeat_s: int
    users: frozenset[str] = frozenset()  # the variables among the two that the user set: theirs win

    def env(self) -> dict[str, str]:
        return {NONBLOCKING_VAR: str(self.nonblocking_s), HEARTBEAT_VAR: str(self.heartbeat_s)}

    def out_of_order(self) -> Optional[str]:
        """Why these waits break the order (one line), or None. Only the user's values can:
        ours are built in order."""
        def named(var: str, value: int) -> str:
            return f"{var}={value}" + (" (yours)" if var in self.users else "")

        nonblocking = named(NONBLOCKING_VAR, self.nonblocking_s)
        heartbeat = named(HEARTBEAT_VAR, self.heartbeat_s)
        if self.nonblocking_s >= self.heartbeat_s:
            return (f"{heartbeat} is not above {nonblocking}: a watchdog that waits for a forming "
                    "communicator's lock would SIGABRT its worker, counted as a crash")
        longest = WORKER_ABORT_DEADLINE_S - 2 * DUMP_WAIT_S - ABORT_ROOM_S
        if self.heartbeat_s > longest:
            return (f"{heartbeat} is above {longest}: a dropped group's destructor, which waits for the "
                    f"heartbeat monitor, would pass the abort's {WORKER_ABORT_DEADLINE_S} s deadline and its "
                    "worker would exit as broken")
        return None


def nonblocking_for(max_world_size: int) -> int:
    """The non-blocking wait that lets a healthy communicator of ``max_world_size`` ranks form."""
    if max_world_size <= NONBLOCKING_BASE_RANKS:
        return NONBLOCKING_BASE_S
    doublings = math.ceil(math.log2(max_world_size / NONBLOCKING_BASE_RANKS))
    return min(NONBLOCKING_BASE_S + NONBLOCKING_PER_DOUBLING_S * doublings, NONBLOCKING_CAP_S)


def _seconds(raw: Optional[str]) -> Optional[int]:
    """A user's value as torch reads it (an integer), or None: unset, or not a number (torch's to judge)."""
    try:
        return int(float(raw)) if raw is not None else None
    except (ValueError, OverflowError):  # "nan", "inf"
        return None


def nccl_waits(max_world_size: int, users_env: Mapping[str, str]) -> NcclWaits:
    """NCCL's two waits for workers of a job of at most ``max_world_size`` ranks. A value the
    user set in ``users_env`` wins, and the heartbeat follows the non-blocking wait, the
    user's too; a user's value that is not a number is left to torch, and ours stand in for
    it here."""
    users = frozenset(var for var in (NONBLOCKING_VAR, HEARTBEAT_VAR) if _seconds(users_env.get(var)) is not None)
    nonblocking = _seconds(users_env.get(NONBLOCKING_VAR))
    if nonblocking is None:
        nonblocking = nonblocking_for(max_world_size)
    heartbeat = _seconds(users_env.get(HEARTBEAT_VAR))
    if heartbeat is None:
        heartbeat = nonblocking + HEARTBEAT_ABOVE_NONBLOCKING_S
    return NcclWaits(nonblocking, heartbeat, users)


def nccl_env(backend: str, max_world_size: int = 1, users_env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """NCCL's settings for workers of ``backend`` (none without NCCL) in a job of at most
    ``max_world_size`` ranks: the runtime's own timers and aborts decide when a ring is
    broken, never NCCL's watchdog. ``users_env``: the variables the user set, which win."""
    if not uses_nccl(backend):
        return {}
    waits = nccl_waits(max_world_size, users_env or {})
    return {
        # 0 = no handling. 1 (tear down) and 3 (skip clean-up) make the watchdog SIGABRT the
        # whole process after a collective timeout or an asynchronous NCCL error: a slow step
        # on one rank, or a lost host, would kill every survivor instead of re-forming.
        # torch's _abort_process_group asks for 0 too: the runtime aborts the ring itself.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        # Before acting on a timeout the watchdog waits 4x this for a flight-recorder dump
        # (60 s by default); a second is enough for the dump and no stall.
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(DUMP_WAIT_S * 1000),
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
        # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: the heartbeat monitor, once it broke out of its
        # loop (a dump requested, a stuck watchdog), sleeps this long before it ends the
        # process, and a group's destructor joins it: 480 s by default, past the abort's
        # deadline, so a group dropped in leave_aborted made its worker exit broken, and a
        # worker's exit hung for 8 min. Under the deadline the destructor returns in time
        # (gpu review G2); a watchdog stuck in a driver call this long ends its process
        # sooner, which its agent replaces anyway.
        # TORCH_NCCL_NONBLOCKING_TIMEOUT: a collective issued while a non-blocking
        # communicator still forms holds its lock for up to this long (30 min unset), and an
        # abort needs that lock: under the abort's deadline the waiting collective raises
        # first (a ring failure) and the abort goes through (gpu review G5(b)). It also
        # bounds a healthy communicator's set-up, hence its growth with the world (N6).
        **waits.env(),
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
    max_world_size: Optional[int] = None,
) -> dict[str, str]:
    """``max_world_size``: the largest world this worker may join, --max-np (None: the
    plan's). NCCL's waits follow it, for the worker's whole life; an unchanging value also
    keeps every worker's environment equal to the warm-start template's (warm_start.py)."""
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
    largest_world = max_world_size if max_world_size is not None else plan.world_size
    if uses_nccl(worker_config.backend):  # before ours are in: the user's own values are told apart
        problem = nccl_waits(largest_world, env).out_of_order()
        if problem:
            _say_once(f"NCCL's waits are out of order: {problem}")
    for name, value in nccl_env(worker_config.backend, largest_world, env).items():
        env.setdefault(name, value)  # the user's own settings win
    env.update(worker_config.to_env())
    env["ELASTIC_WORKER_AGENT_PID"] = str(os.getpid())
    return env


@functools.lru_cache(maxsize=None)
def _say_once(warning: str) -> None:
    """Each warning once per agent, not at every worker's start."""
    log.warning("%s", warning)
