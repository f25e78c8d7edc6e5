"""--evict-stragglers, the agent's side: a straggler's host leaves only while the rest keeps --min-np."""

from __future__ import annotations

import pytest

from elastic.agent.straggler_eviction import verdict
from elastic.contract.agent_channel import Straggler
from elastic.rendezvous import RoundPlan, Slot


def _plan(world_by_member: dict[str, int]) -> RoundPlan:
    slots = tuple(Slot(m, f"{m}.w{i}") for m, n in world_by_member.items() for i in range(n))
    return RoundPlan(round=4, slots=slots, hosts={m: (m, "127.0.0.1") for m in world_by_member},
                     store_addr="127.0.0.1:1", created=0.0)


@pytest.mark.parametrize("hosts, remaining, min_np, evict, kept", [
    ({"a": 1, "b": 1, "slow": 1}, 2, 2, True, 2),
    ({"a": 1, "b": 1, "slow": 1}, 2, 3, False, 2),  # the rest would be below --min-np
    ({"a": 1, "b": 1, "slow": 1}, 1, 2, False, 1),  # another straggler host leaves in the same window
    ({"a": 1, "slow": 2}, 2, 2, False, 1),  # the worker counted its host as one; the agent knows it holds two
])
def test_the_verdict(hosts, remaining, min_np, evict, kept):
    plan = _plan(hosts)
    decided = verdict(Straggler(4, 2, 3.0, remaining), plan, ours=hosts["slow"], min_np=min_np)
    assert (decided.evict, decided.remaining) == (evict, kept)
    if not evict:
        assert decided.refusal(plan, "slow.w0", 2) == (
            f"round 4: not evicting straggler slow.w0 (rank 2): {kept} workers would remain, below --min-np {min_np}")
