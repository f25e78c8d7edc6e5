"""``--evict-stragglers``: the agent of a persistently slow worker takes its host out.

A worker that finds itself a persistent straggler (``elastic/worker/stragglers.py``)
tells its agent so (a ``Straggler`` message, ``contract/agent_channel.py``). With
``--evict-stragglers`` the agent then leaves exactly as on SIGTERM: its workers are
withdrawn, the ring switches without them at its next commit, so no step is lost, and
they exit 0. It does so only when the workers that stay keep the job at or above
--min-np: the worker's ``remaining`` counts the workers of every host reported in the
same window (every rank computes the same list), and the agent checks its own view of
the round too. Otherwise the straggler is only reported: below --min-np the coordinator
would stop the whole job rather than shrink it.

``verdict`` decides, as a pure function; ``Agent`` carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.rendezvous import RoundPlan

from ..contract.agent_channel import Straggler
from ..contract.straggler_policy import eviction_allowed


@dataclass(frozen=True)
class Verdict:
    evict: bool
    remaining: int  # the workers the job keeps if this host and the window's other stragglers leave
    min_np: int

    def refusal(self, plan: RoundPlan, worker: str, rank: int) -> str:
        return (f"round {plan.round}: not evicting straggler {worker} (rank {rank}): {self.remaining} workers "
                f"would remain, below --min-np {self.min_np}")


def verdict(message: Straggler, plan: RoundPlan, ours: int, min_np: int) -> Verdict:
    """Whether this agent, holding ``ours`` workers of ``plan``, may take its host out."""
    remaining = min(message.remaining, plan.world_size - ours)
    return Verdict(eviction_allowed(plan.world_size, plan.world_size - remaining, min_np), remaining, min_np)
