"""The publish check of durable checkpoints: may a write made in round r still be published?

Only rank 0 writes, in the background, from its last commit; the check is asked right
before the rename that publishes (checkpoint/durable.py). The rule: **the worker has
been a member of every round after r** (and the job has not failed). Being in the
newest plan is not enough. A host cut off (link down) is declared lost, the survivors
go on and write their own checkpoints; when the link returns, its agent registers
again under the same member id with the same worker ids, so the very process whose
write of round r was held up (by the cut, a slow disk, a frozen NFS mount) is in the
newest plan again. Publishing then would put a state the job abandoned (the
survivors rolled back to their last common commit and re-ran from there, in another
world) under a step name: a rewrite of a step the survivors already wrote becomes
``step-<n>.1``, which loaders prefer, and a newer step is only safe from it as long
as one stays on disk.

A worker that stayed in every round since r went through each change with the ring:
a join or a graceful leave switches at a commit (nothing rolled back), and a ring
that broke without losing it syncs the newest commit, which it holds. So its commit
of round r is on the job's history, and the write may go.

The plans of past rounds (``rounds/<n>``, the newest ``KEEP_ROUNDS``) are read only
when the plan moved past r, which is rare between two checkpoints: the usual cost is
two reads. Anything that cannot be proved (etcd unreachable, a round since r no longer
kept, no plan at all) refuses: the next write will be made.
"""

from __future__ import annotations

from typing import Optional

from elastic.checkpoint import PublishRefusal
from elastic.rendezvous import FAILED, Etcd, JobKeys, JobStatus, RendezvousError, RoundPlan

from .left_behind import readable_plans


def refusal(etcd: Etcd, keys: JobKeys, worker: str, round_number: int) -> Optional[str]:
    """Why a write of ``worker`` made in ``round_number`` must not be published, or None."""
    unknown = f"cannot tell whether its round {round_number} is current"
    try:
        status_kv, plan_kv = etcd.get(keys.status), etcd.get(keys.plan)
        if status_kv is not None and JobStatus.from_json(status_kv.value).state == FAILED:
            return "the job failed"
        if plan_kv is None:
            return f"{unknown}: etcd holds no plan of the job"
        newest = RoundPlan.from_json(plan_kv.value)
        if newest.round <= round_number:
            return None
        kvs, _ = etcd.get_prefix(keys.prefix + "rounds/")
    except RendezvousError as exc:
        return f"{unknown}: etcd unreachable ({exc})"
    # An unreadable kept round counts as not kept: the write is refused, never wrongly published.
    plans = {plan.round: plan for plan in readable_plans(kvs)}
    for number in range(round_number + 1, max([newest.round, *plans]) + 1):
        plan = plans.get(number)
        if plan is None:
            return f"{unknown}: round {number} is no longer kept in etcd"
        if worker in plan.lost:
            return f"its round {round_number} is over: round {number} declared this worker lost"
        if plan.rank_of(worker) is None:
            return f"its round {round_number} is over: round {number} went on without this worker"
    return None


def make(etcd: Etcd, keys: JobKeys, worker: str, round_number: int):
    """``still_current()`` for the checkpoint writer: True, or PublishRefusal with the reason
    (the writer logs it, with the step, in its one line about the refused write)."""

    def still_current() -> bool:
        why = refusal(etcd, keys, worker, round_number)
        if why is not None:
            raise PublishRefusal(why)
        return True

    return still_current
