"""What is left of a job once it ended: kept for a day, then gone.

While a job runs, its status, plan and rounds are on the job lease (job_lease.py):
they must outlive any one member. Once it ended, each agent on its way out calls
``keep_ended_job``: the first moves those keys onto one fresh lease of
``KEEP_ENDED_S`` (24 h) in a single transaction, so ``elastic-run status`` tells
how the job ended until the lease expires and etcd deletes them. Leftover reset
requests and plain-store addresses mean nothing after the end and go at once, and so
does the job lease.

The transaction compares the status key's revision: when several agents end at
once, one wins and the others see the status on a lease already and stop. A job
id used again later then starts from nothing rather than from an old "succeeded".
"""

from __future__ import annotations

import logging

from .control import FAILED, STOPPING, SUCCEEDED, JobStatus
from .errors import MalformedValueError, RendezvousError
from .etcd import Delete, Etcd, ModRevisionEquals, Put
from .keys import KEEP_ENDED_S, JobKeys

log = logging.getLogger(__name__)

# A stopping job ends once its workers reach the commit: by the time an agent leaves
# with this state, its own workers have stopped there.
ENDED = (SUCCEEDED, FAILED, STOPPING)

# etcd refuses transactions of more than 128 operations by default.
_MAX_TXN_OPS = 100


def _ended(value: bytes) -> bool:
    try:
        return JobStatus.from_json(value).state in ENDED
    except MalformedValueError:
        return False


def keep_ended_job(etcd: Etcd, keys: JobKeys, *, keep_s: float = KEEP_ENDED_S, deadline: float = 3.0) -> bool:
    """Put an ended job's history on a ``keep_s`` lease; True if this call did it.

    Bounded by ``deadline`` per request: an agent on its way out must not wait for an
    etcd that is away (the keys then simply stay, as they did before).
    """
    try:
        status = etcd.get(keys.status, retry_deadline=deadline)
        job_kv = etcd.get(keys.job_lease, retry_deadline=deadline)
        job_lease = job_kv.lease if job_kv is not None else 0
        if status is None or status.lease not in (0, job_lease) or not _ended(status.value):
            return False  # still running (or never ran), or already kept by another agent
        kvs, _ = etcd.get_prefix(keys.prefix, retry_deadline=deadline)
        history = [kv for kv in kvs if kv.lease in (0, job_lease) and kv.key != keys.job_lease and (
            kv.key.startswith(keys.control) or kv.key.startswith(keys.prefix + "rounds/") or kv.key == keys.progress)]
        leftovers = [kv for kv in kvs if kv.key.startswith((keys.requests, keys.prefix + "plainstores/"))]
        lease = etcd.grant_lease(keep_s, retry_deadline=deadline)
        won, _ = etcd.txn([ModRevisionEquals(keys.status, status.mod_revision)],
                          [Put(kv.key, kv.value, lease=lease) for kv in history[:_MAX_TXN_OPS]],
                          retry_deadline=deadline)
        if not won:
            etcd.revoke_lease(lease, retry_deadline=deadline)
            return False
        for start in range(_MAX_TXN_OPS, len(history), _MAX_TXN_OPS):  # only with a huge control prefix
            etcd.txn([], [Put(kv.key, kv.value, lease=lease) for kv in history[start:start + _MAX_TXN_OPS]],
                     retry_deadline=deadline)
        for start in range(0, len(leftovers), _MAX_TXN_OPS):
            etcd.txn([], [Delete(kv.key) for kv in leftovers[start:start + _MAX_TXN_OPS]], retry_deadline=deadline)
        if job_lease:
            etcd.revoke_lease(job_lease, retry_deadline=deadline)  # and whatever else was left on it
        log.debug("job %s ended: its status and %d key(s) kept for %gs", keys.job_id, len(history), keep_s)
        return True
    except RendezvousError as exc:
        log.info("job %s ended; its status could not be put on a %gs lease (%s): it stays", keys.job_id, keep_s, exc)
        return False
