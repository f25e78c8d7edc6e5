"""The etcd key layout of a job: the one place that names keys.

Everything of one job lives under ``/elastic/<job-id>/``; two jobs on one etcd
never read or watch each other's keys.

    /elastic/<job>/members/<member-id>   JSON Member, bound to the member's lease.
                                         Only the coordinator watches this prefix.
    /elastic/<job>/coordinator           member id of the elected coordinator,
                                         bound to its lease (etcd election recipe).
    /elastic/<job>/requests/<worker-id>  JSON ResetRequest: a worker saw its ring
                                         break and asks for a new round.
    /elastic/<job>/rounds/<n>            JSON RoundPlan of round n, written once ever;
                                         only the newest KEEP_ROUNDS are kept.
    /elastic/<job>/control/plan          JSON RoundPlan of the newest round.
    /elastic/<job>/control/status        JSON JobStatus (running / succeeded / failed).
    /elastic/<job>/control/backend       JSON {"backend", "host"}: the job's process-group backend,
                                         written once by the first agent; the others use it
                                         or refuse to start (elastic/agent/job_backend.py).
    /elastic/<job>/control/waiting       JSON WaitingNotice while fewer than min_np workers
                                         are present (waiting.py), on the coordinator's
                                         lease; deleted when the wait ends.
    /elastic/<job>/reach/<member-id>     JSON ReachReport: the members this member's agent
                                         could not connect to while its workers were
                                         stalled (reachability.py), on its lease.
                                         Only the coordinator watches this prefix.
    /elastic/<job>/plainstores/<n>       "host:port" of round n's fresh TCPStore for
                                         workers that use torchrun's env:// init
                                         (deleted with the store, two rounds later).
    /elastic/<job>/plainstores/none      "elastic": an agent saw one of its workers call
                                         elastic.init(), so the job's workers need no
                                         such store; none is served or waited for since.
    /elastic/.served/offers/<member>     JSON Offer: this agent could hold a member of the etcd
                                         its bare-metal job serves itself (served.py), on its
                                         lease. Not under a job: one etcd, one set of members,
                                         whichever jobs use it (".served" is no job id).
    /elastic/.served/invites/<member>    JSON invitation to start the member the steward
                                         added (its --initial-cluster); deleted with it.
    /elastic/.served/steward             member name of the agent that changes the members,
                                         on its lease (election recipe).
    /elastic/<job>/control/lease         the job lease (hex id), on itself: plans, rounds,
                                         the status, requests and plain stores are put on
                                         it; a coordinator refreshes it every
                                         JOB_LEASE_REFRESH_S, so it expires only when
                                         every agent of the job is gone (an abandoned job).

Every key is bounded: requests are deleted once a round answers them, old rounds
and plain stores are deleted as new ones are written, members go with leases, and
the keys of a job whose agents all died go with the job lease (JOB_LEASE_S after
the last refresh).
When the job ends, its status, newest plan and kept rounds are put on one lease
of KEEP_ENDED_S (history.py), so `elastic-run status` can still tell how it
ended, and then they vanish; its leftover requests and plain stores go at once.

Agents and workers watch only ``control/`` (a handful of keys), so the etcd
traffic of a round is O(N) in the number of members: N member writes seen by
one watcher, one plan write seen by N watchers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError

# Plans of past rounds kept for people (and tools) reading what happened.
KEEP_ROUNDS = 32

# How long an ended job's status and rounds stay readable (then their lease expires).
KEEP_ENDED_S = 24 * 3600.0

# The job lease: how long the keys of a job whose agents all died stay (the deploy's
# etcd quota is 2 GiB: abandoned jobs must not fill it), and how often a coordinator
# renews it while the job lives.
JOB_LEASE_S = 7 * 24 * 3600.0
JOB_LEASE_REFRESH_S = 3600.0

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ROOT = "/elastic"
# The etcd a bare-metal job serves itself (served.py): its offers, invitations, steward.
SERVED_PREFIX = ROOT + "/.served/"


def validate_job_id(job_id: str) -> str:
    if not _JOB_ID.match(job_id or ""):
        raise ConfigError(
            f"invalid job id {job_id!r}: use 1-128 letters, digits, '.', '_' or '-'"
        )
    return job_id


@dataclass(frozen=True)
class JobKeys:
    job_id: str
    root: str = ROOT

    def __post_init__(self) -> None:
        validate_job_id(self.job_id)

    @property
    def prefix(self) -> str:
        return f"{self.root}/{self.job_id}/"

    @property
    def members(self) -> str:
        return self.prefix + "members/"

    def member(self, member_id: str) -> str:
        return self.members + member_id

    @property
    def coordinator(self) -> str:
        return self.prefix + "coordinator"

    @property
    def requests(self) -> str:
        return self.prefix + "requests/"

    def request(self, worker_id: str) -> str:
        return self.requests + worker_id

    def round(self, number: int) -> str:
        return f"{self.prefix}rounds/{number:08d}"

    def plain_store(self, number: int) -> str:
        return f"{self.prefix}plainstores/{number:08d}"

    @property
    def no_plain_stores(self) -> str:
        return f"{self.prefix}plainstores/none"

    @property
    def reach(self) -> str:
        return self.prefix + "reach/"

    def reach_report(self, member_id: str) -> str:
        return self.reach + member_id

    @property
    def progress(self) -> str:
        """How far training has got (elastic/agent/run_watch.py): outside control/, whose
        watchers (every agent and worker) need not wake up for it."""
        return self.prefix + "progress"

    @property
    def control(self) -> str:
        return self.prefix + "control/"

    @property
    def plan(self) -> str:
        return self.control + "plan"

    @property
    def status(self) -> str:
        return self.control + "status"

    @property
    def waiting(self) -> str:
        return self.control + "waiting"

    @property
    def job_lease(self) -> str:
        return self.control + "lease"

    @property
    def backend(self) -> str:
        return self.control + "backend"
