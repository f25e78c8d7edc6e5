"""Points of the runtime where a test injects a fault that no timing from outside could
hit reliably: no-ops unless a test installed a hook.

Nothing here reads the environment: a test's fault plan (tests/fakes/fault_plan/) is a
``sitecustomize`` that the test puts first on the workers' PYTHONPATH and that calls
``install`` in each worker process. Production processes never install one. The hooks
are called at every pass; which pass a fault hits (a round, a commit) is the plan's choice.

``entering_round(round, rank)``
    A round has formed at its store (every worker arrived), before ``init_process_group``.
``sharded(point, rank, commit=, round_number=)``
    A sharded commit or sync at ``point``: ``replicating`` (commit ``commit``'s copies
    posted to the replicas, not yet arrived) or ``resharding`` (a re-shard's transfers in
    round ``round_number`` posted, not yet complete).
"""

from __future__ import annotations

from typing import Callable

_hooks: dict[str, Callable[..., None]] = {}

POINTS = ("entering_round", "sharded")


def install(point: str, hook: Callable[..., None]) -> None:
    """Call ``hook`` with the point's arguments whenever the runtime passes ``point``."""
    if point not in POINTS:
        raise ValueError(f"no fault point {point!r}; the points are {', '.join(POINTS)}")
    _hooks[point] = hook


def entering_round(round_number: int, rank: int) -> None:
    hook = _hooks.get("entering_round")
    if hook is not None:
        hook(round_number, rank)


def sharded(point: str, rank: int, *, commit: int, round_number: int) -> None:
    hook = _hooks.get("sharded")
    if hook is not None:
        hook(point, rank, commit, round_number)
