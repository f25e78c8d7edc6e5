"""Exit statuses that mean something to another process.

A worker's status is read by its agent; ``elastic-run``'s by whoever started it: a
shell, Kubernetes (a Job's ``podFailurePolicy`` matches on it), Slurm. Each value
is one kind of ending, so that whoever reads it can act without reading logs.
"""

from __future__ import annotations

# -- elastic-run (the agent of one host) ---------------------------------------------
SUCCEEDED = 0  # training finished, or this host left the job gracefully
JOB_FAILED = 1  # the job failed outside the user's code (restarts or resets used up, etcd lost)
USAGE_ERROR = 2  # bad options or input: one line on stderr, nothing started
USER_ERROR = 3  # a worker's training script raised: running it again cannot help

# -- a worker process -------------------------------------------------------------------
# The process itself is broken (a sticky CUDA error, a device fault): its agent replaces
# it like a crash (within --max-restarts), never as a user error.
WORKER_BROKEN = 70
