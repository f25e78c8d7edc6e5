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

PREFIX = "ELASTIC_WORKER_"
# Never passed on to a worker: the etcd password and the job secret (cli/etcd_secrets.py).
# A worker reads the password from the 0600 file ``etcd_password_file`` names.
INHERITED_SECRETS = ("ELASTIC_ETCD_PASSWORD", "ELASTIC_JOB_SECRET")


@dataclass(frozen=True)
class WorkerConfig:
    job_id: str
    endpoints: str
    worker_id: str
    member_id: str
    host_id: str
    round: int
    backend: str = "gloo"
    collective_timeout: float = 60.0
    rdzv_timeout: float = 600.0
    rdzv_ttl: float = 10.0  # the agent's lease TTL: no plan can leave us behind in less
    max_resets: int = 20
    reset_window: float = 3600.0
    events_file: Optional[str] = None
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
            if raw is None:
                continue
            kind = str(field.type)
            if kind == "bool":
                kwargs[name] = raw == "True"  # as to_env writes it
            elif "int" in kind and name != "checkpoint_interval":
                kwargs[name] = int(raw)
            elif "float" in kind:
                kwargs[name] = float(raw)
            else:
                kwargs[name] = raw
        return cls(**kwargs)
