"""``--evict-stragglers``: the agent of a persistently slow worker takes its host out.

A worker reports itself as a straggler (``straggler_detected``, see
``elastic/worker/stragglers.py``) in the events file its agent reads. With
``--evict-stragglers`` the agent then leaves exactly as on SIGTERM (``_on_signal``):
its workers are withdrawn, the ring switches without them at its next commit, so
no step is lost, and they exit 0. It does so only when the workers that stay keep
the job at or above --min-np: the worker's ``remaining`` counts the workers of every
host reported in the same window (every rank computes the same list), and the agent
checks its own view of the round too. Otherwise the straggler is only reported:
below --min-np the coordinator would stop the whole job rather than shrink it.
"""

from __future__ import annotations

import logging
import signal

from ..contract.straggler_policy import eviction_allowed

log = logging.getLogger(__name__)


def on_straggler_event(agent, event: dict) -> None:
    """Called with each event the agent reads (``Agent._on_event``)."""
    if event.get("event") != "straggler_detected" or not agent.config.stragglers.evict:
        return
    worker = event.get("worker")
    plan = agent._plan
    if worker not in agent._workers or agent._leaving_since is not None or plan is None:
        return  # another agent's worker (a shared log directory), or already leaving
    min_np = agent.config.settings.min_np
    ours = len(plan.local_ranks(agent.member_id))
    remaining = min(int(event.get("remaining", 0)), plan.world_size - ours)
    if not eviction_allowed(plan.world_size, plan.world_size - remaining, min_np):
        log.warning(
            "round %s: not evicting straggler %s (rank %s): %d workers would remain, below --min-np %d",
            plan.round, worker, event.get("rank"), remaining, min_np,
        )
        return
    agent.events.emit(
        "straggler_evicted", worker=worker, ratio=event.get("ratio"), remaining=remaining, min_np=min_np,
    )
    agent._on_signal(signal.SIGTERM)  # the graceful leave, the same as a scale-down
