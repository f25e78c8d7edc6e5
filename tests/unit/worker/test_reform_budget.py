"""The re-forming loop of ``@elastic.run`` against a fake runtime: which error a worker
exits with once its reset budget is spent (the agent treats the two kinds differently)."""

from __future__ import annotations

import pytest

from elastic.contract.errors import PeersUnreachable, ResetLimitExceeded
from elastic.contract.faults import RING, Fault
from elastic.worker.outcome import Broken
from elastic.worker.recovery import _reform
from elastic.contract.reset_budget import ResetBudget


class _FailingRuntime:
    """``reform`` raises ``error()`` every time, as a ring that never forms."""

    def __init__(self, error):
        self.error = error
        self.round = 0
        self.attempts = 0

    def reform(self, reason, failed):
        self.attempts += 1
        self.round += 1
        raise self.error(self.round)


def _interruption():
    return Broken(Fault(RING, "RuntimeError: Connection closed by peer"), detected=0.0)


def test_a_budget_spent_on_unreachable_peers_exits_as_a_network_fault_without_its_traceback():
    runtime = _FailingRuntime(lambda n: PeersUnreachable(n, ["10.0.0.1", "10.0.0.2"], "RuntimeError: Connect timeout"))
    with pytest.raises(PeersUnreachable) as raised:
        _reform(runtime, _interruption(), ResetBudget(limit=2, window_s=60))
    assert runtime.attempts == 3  # two re-formations allowed, the third is over budget
    assert raised.value.round == 3 and raised.value.addresses == ["10.0.0.1", "10.0.0.2"]
    # A fresh error: the one runtime.reform raised (and its frames, holding the
    # half-built process group) is not kept alive by it.
    assert raised.value.__context__ is None and raised.value.__cause__ is None


def test_a_budget_spent_on_other_failures_exits_as_reset_limit_exceeded_naming_the_last_one():
    runtime = _FailingRuntime(lambda n: RuntimeError(f"Connection closed by peer (round {n})"))
    with pytest.raises(ResetLimitExceeded, match=r"--max-resets 2 .*last failure: RuntimeError: .*round 3"):
        _reform(runtime, _interruption(), ResetBudget(limit=2, window_s=60))


def test_a_user_error_while_re_forming_is_not_retried():
    runtime = _FailingRuntime(lambda n: ValueError("shapes differ"))
    with pytest.raises(ValueError):
        _reform(runtime, _interruption(), ResetBudget(limit=5, window_s=60))
    assert runtime.attempts == 1
