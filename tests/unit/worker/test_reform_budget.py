"""The re-forming loop of ``@elastic.run`` against a fake ring entry: which error a worker
exits with once its reset budget is spent (the agent treats the two kinds differently)."""

from __future__ import annotations

import pytest

from elastic.contract.errors import PeersUnreachable, ResetLimitExceeded
from elastic.contract.faults import RING, Fault
from elastic.worker.outcome import Broken
from elastic.worker.recovery import _next_ring
from elastic.contract.reset_budget import ResetBudget
from tests.fakes.ring import FakeRing


class _FailingEntry:
    """``next_plan`` raises ``error(attempt)`` every time, as rounds that never form."""

    def __init__(self, error):
        self.error = error
        self.attempts = 0

    def next_plan(self, after_round, reason, failed):
        self.attempts += 1
        raise self.error(self.attempts)

    def leave_unformed(self, round_number):
        pass


class _Session:
    def __init__(self, entry):
        self.entry = entry


def _reform(entry, outcome, budget):
    return _next_ring(_Session(entry), FakeRing(round=0), outcome, budget)


def _interruption():
    return Broken(Fault(RING, "RuntimeError: Connection closed by peer"), detected=0.0)


def test_a_budget_spent_on_unreachable_peers_exits_as_a_network_fault_without_its_traceback():
    entry = _FailingEntry(lambda n: PeersUnreachable(n, ["10.0.0.1", "10.0.0.2"], "RuntimeError: Connect timeout"))
    with pytest.raises(PeersUnreachable) as raised:
        _reform(entry, _interruption(), ResetBudget(limit=2, window_s=60))
    assert entry.attempts == 3  # two re-formations allowed, the third is over budget
    assert raised.value.round == 3 and raised.value.addresses == ["10.0.0.1", "10.0.0.2"]
    # A fresh error: the one the re-formation raised (and its frames, holding the
    # half-built process group) is not kept alive by it.
    assert raised.value.__context__ is None and raised.value.__cause__ is None


def test_a_budget_spent_on_other_failures_exits_as_reset_limit_exceeded_naming_the_last_one():
    entry = _FailingEntry(lambda n: RuntimeError(f"Connection closed by peer (round {n})"))
    with pytest.raises(ResetLimitExceeded, match=r"--max-resets 2 .*last failure: RuntimeError: .*round 3"):
        _reform(entry, _interruption(), ResetBudget(limit=2, window_s=60))


def test_a_user_error_while_re_forming_is_not_retried():
    entry = _FailingEntry(lambda n: ValueError("shapes differ"))
    with pytest.raises(ValueError):
        _reform(entry, _interruption(), ResetBudget(limit=5, window_s=60))
    assert entry.attempts == 1
