"""What an agent is told (``AgentConfig``, from the command line) and what it tells
each worker it starts (``WorkerConfig``, through the environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from elastic.rendezvous import RendezvousSettings

from ..contract.log_files import DEFAULT_MAX_BYTES
from ..contract.devices import uses_nccl
from ..contract.straggler_policy import StragglerOptions
from ..contract.timeouts import Timeouts
from ..contract.worker_config import WorkerConfig
from .chaos import ChaosConfig
from .output_pump import ConsoleRanks


@dataclass(frozen=True)
class AgentConfig:
    command: tuple[str, ...]  # worker argv after the interpreter: script + args, or -m module + args
    nproc_per_node: int
    settings: RendezvousSettings
    job_id: str
    host_id: str
    host_addr: str
    ttl: float
    collective_timeout: float
    max_resets: int
    reset_window: float
    max_restarts: int
    backend: str
    grace_period: float
    log_dir: Optional[str] = None
    health_port: Optional[int] = None
    health_addr: Optional[str] = None  # where the health server listens (default: host_addr)
    checkpoint: dict = field(default_factory=dict)  # checkpoint_dir/every/interval/keep
    socket_ifname: Optional[str] = None  # the interface holding host_addr, for gloo/NCCL (addressing.py)
    etcd_options: dict = field(default_factory=dict)  # etcd_ca/cert/key/user/password/retry_deadline
    final_checkpoint_timeout: float = 600.0  # for a worker still writing the final checkpoint
    hang_timeout: Optional[float] = None  # None: derived from commit intervals; 0: off
    stragglers: StragglerOptions = StragglerOptions()  # --straggler-ratio, --evict-stragglers
    chaos: Optional[ChaosConfig] = None  # --chaos-kill-every: kill our own workers (chaos.py)
    leave_exit_code: int = 0  # --leave-exit-code: our status after leaving a job that goes on
    shard_replicas: int = 1  # --shard-replicas: copies of each committed shard (ShardedState)
    console_ranks: ConsoleRanks = ConsoleRanks()  # --console-ranks: whose output and bars the console shows
    log_max_bytes: int = DEFAULT_MAX_BYTES  # --log-max-bytes: events.jsonl and worker logs rotate there (0: never)
    warm_starts: bool = True  # fork workers from a template that has imported torch (warm_start.py); --cold-starts

    @property
    def timeouts(self) -> Timeouts:
        """The job's timeouts together (reviewed at launch: cli/launch.py); every worker is
        given the same (``WorkerConfig.timeouts``)."""
        return Timeouts(ttl=self.ttl, collective=self.collective_timeout, rendezvous=self.settings.timeout,
                        settle=self.settings.settle, hang=self.hang_timeout, nccl=uses_nccl(self.backend))


def config_for_worker(cfg: AgentConfig, worker_id: str, round_number: int, *, endpoints: str, member_id: str,
                      events_file: str, scratch: str, progress_file: Optional[str], stacks_file: Optional[str],
                      final_checkpoint_file: str, device_slot: Optional[int] = None,
                      agent_channel: Optional[str] = None, restarted_all: bool = False) -> WorkerConfig:
    """The runtime's settings of one worker; the files named are the agent's ways of
    hearing from it (error report, elastic marker, progress board, stacks, the channel
    of what it tells its agent to act on). ``restarted_all``: started after a failure
    with no elastic worker left on this host (a torchrun-style job, every worker
    restarted): nobody runs a ring it would join."""
    timeouts = cfg.timeouts
    return WorkerConfig(
        job_id=cfg.job_id,
        endpoints=endpoints,
        worker_id=worker_id,
        member_id=member_id,
        host_id=cfg.host_id,
        round=round_number,
        backend=cfg.backend,
        collective_timeout=timeouts.collective,
        rdzv_timeout=timeouts.rendezvous,
        rdzv_ttl=timeouts.ttl,
        rdzv_settle=timeouts.settle,
        hang_timeout=timeouts.hang,
        max_resets=cfg.max_resets,
        reset_window=cfg.reset_window,
        events_file=events_file,
        agent_channel=agent_channel,
        error_file=os.path.join(scratch, f"{worker_id}.error"),
        marker_file=os.path.join(scratch, f"{worker_id}.elastic"),
        final_checkpoint_file=final_checkpoint_file,
        progress_file=progress_file,
        stacks_file=stacks_file,
        straggler_ratio=cfg.stragglers.ratio,
        device_slot=device_slot,
        shard_replicas=cfg.shard_replicas,
        restarted_all=restarted_all,
        **cfg.etcd_options,
        **cfg.checkpoint,
    )
