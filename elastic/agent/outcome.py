"""How an agent ends: the job's final status -> elastic-run's exit status.

Every agent of a job reads the same status from etcd, so every host exits with the
same status, whichever host's worker failed: a scheduler that matches on it (a
Kubernetes Job's ``podFailurePolicy``, a Slurm script) sees one kind of ending.
"""

from __future__ import annotations

from elastic.rendezvous import FAILED, STOPPING, SUCCEEDED, JobStatus
from elastic.rendezvous.control import CAUSE_USER_CODE

from ..contract import exit_codes


def exit_status(status: JobStatus) -> int:
    """elastic-run's exit status once the job has ended (or stopped at a commit)."""
    if status.state in (SUCCEEDED, STOPPING):
        return exit_codes.SUCCEEDED
    if status.state == FAILED and status.cause == CAUSE_USER_CODE:
        return exit_codes.USER_ERROR
    return exit_codes.JOB_FAILED
