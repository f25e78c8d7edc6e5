"""What the agent tells a worker: the only place a worker reads its environment.

The agent sets torchrun's variables (RANK, WORLD_SIZE, ...) for scripts written
for torchrun, and the ``ELASTIC_WORKER_*`` variables below for the elastic
runtime. Without ``ELASTIC_WORKER_ID`` the process was not started by an agent
and ``elastic.init()`` gives a world of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from .devices import uses_nccl
from .timeouts import Timeouts

PREFIX = "ELASTIC_WORKER_"
# Never passed on to a worker: the etcd password, the job secret and the path to it (cli/etcd_secrets.py).
# A worker reads the password from the 0600 file ``etcd_password_file`` names.
INHERITED_SECRETS = ("ELASTIC_ETCD_PASSWORD", "ELASTIC_JOB_SECRET", "ELASTIC_JOB_SECRET_FILE")  # (review 2, L4)


@dataclass(frozen=True)
class WorkerConfig:
    job_id: str
    endpoints: str
    worker_id: str
    member_id: str
    host_id: str
    round: int
    backend: str = "gloo"
    # The job's Timeouts (timeouts.py), one value each through the environment; read them
    # together as ``timeouts``. (The names below are read one by one too, for now.)
    collective_timeout: float = Timeouts.collective
    rdzv_timeout: float = Timeouts.rendezvous
    rdzv_ttl: float = Timeouts.ttl  # the agent's lease TTL: no plan can leave us behind in less
    rdzv_settle: float = Timeouts.settle
    hang_timeout: Optional[float] = Timeouts.hang
    max_resets: int = 20
    reset_window: float = 3600.0
    events_file: Optional[str] = None
    agent_channel: Optional[str] = None  # where the worker tells its agent what to act on (agent_channel.py)
    error_file: Optional[str] = None
    marker_file: Optional[str] = None
    final_checkpoint_file: Optional[str] = None  # exists while rank 0 writes the final checkpoint
    progress_file: Optional[str] = None  # progress marks for the agent's watchdog (None: off)
    stacks_file: Optional[str] = None  # where SIGUSR1 dumps every thread's stack
    etcd_ca: Optional[str] = None
    etcd_cert: Optional[str] = None
    etcd_key: Optional[str] = None
    etcd_user: Optional[str] = None
    etcd_password_file: Optional[str] = None  # a 0600 file: the password is never in the environment
    etcd_retry_deadline: Optional[float] = None  # --etcd-retry-deadline (None: EtcdConfig's default)
    etcd_member_sync: Optional[float] = None  # follow etcd's member list every N s (a served etcd: served.py)
    checkpoint_dir: Optional[str] = None
    checkpoint_every: Optional[int] = None
    checkpoint_interval: Optional[float] = None
    checkpoint_keep: int = 3
    checkpoint_allow_fresh_start: bool = False  # unreadable checkpoints are skipped, not a failure
    straggler_ratio: float = 1.5  # --straggler-ratio: compute time over the median that counts as slow
    device_slot: Optional[int] = None  # LOCAL_RANK and CUDA device for the life of the process (device_slots.py)
    shard_replicas: int = 1  # --shard-replicas: copies of each committed shard (ShardedState)
    # Started because every worker of the job restarts (torchrun's semantics, a script that
    # does not follow rounds itself): nobody runs a ring this worker would join.
    restarted_all: bool = False

    @property
    def timeouts(self) -> Timeouts:
        """The job's timeouts, the same object the agent was given (``AgentConfig.timeouts``)."""
        return Timeouts(ttl=self.rdzv_ttl, collective=self.collective_timeout, rendezvous=self.rdzv_timeout,
                        settle=self.rdzv_settle, hang=self.hang_timeout, nccl=uses_nccl(self.backend))

    def to_env(self) -> dict[str, str]:
        env = {}
        for name, value in self.__dict__.items():
            if value is not None:
                env[PREFIX + name.upper()] = str(value)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Optional["WorkerConfig"]:
        if PREFIX + "WORKER_ID" not in environ:
            return None
        kwargs = {}
        for name, field in cls.__dataclass_fields__.items():
            raw = environ.get(PREFIX + name.upper())
            if raw is not None:
                kwargs[name] = _PARSE[str(field.type)](raw)
        return cls(**kwargs)


# How each field's value is read back from the text ``to_env`` wrote (str(value)); a
# field of another type fails tests/unit/contract/test_worker_config_flags.py.
_PARSE = {
    "str": str, "Optional[str]": str,
    "int": int, "Optional[int]": int,
    "float": float, "Optional[float]": float,
    "bool": lambda raw: raw == "True",
}
