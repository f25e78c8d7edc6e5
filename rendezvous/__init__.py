"""etcd v3 rendezvous: leases, members, rounds and plans (see keys.py for the layout)."""

from .control import FAILED, RUNNING, STOPPING, SUCCEEDED, ControlChannel, JobStatus
from .coordinator import Coordinator
from .embedded import EmbeddedEtcd, EmbeddedEtcdCluster, find_etcd_binary
from .errors import (
    ConfigError,
    LeaseLostError,
    MalformedValueError,
    RendezvousAuthError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from .etcd import Etcd, EtcdConfig, KeyValue
from .history import keep_ended_job
from .job_view import JobView, job_view, read_job
from .keys import JobKeys, validate_job_id
from .membership import MemberRegistration
from .participant import Participant, new_member_id
from .rounds import Member, RendezvousSettings, RoundPlan, Slot, decide
from .session import Session

__all__ = [
    "ConfigError", "ControlChannel", "Coordinator", "EmbeddedEtcd", "EmbeddedEtcdCluster", "Etcd", "EtcdConfig",
    "FAILED", "JobKeys", "JobStatus", "JobView", "job_view", "keep_ended_job", "read_job", "KeyValue", "LeaseLostError", "MalformedValueError", "Member",
    "MemberRegistration", "Participant", "RUNNING", "RendezvousAuthError",
    "RendezvousClosedError", "RendezvousConnectionError", "RendezvousError",
    "RendezvousSettings", "RendezvousTimeoutError", "RoundPlan", "STOPPING", "SUCCEEDED", "Session",
    "Slot", "decide", "find_etcd_binary", "new_member_id", "validate_job_id",
]
