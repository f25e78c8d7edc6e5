"""--max-resets is a budget per --reset-window, not over the process's life."""

from types import SimpleNamespace

from elastic.agent.agent import Agent
from elastic.contract.reset_budget import ResetBudget, RoundFailures


def test_failures_far_apart_never_exhaust_the_budget():
    budget = ResetBudget(limit=2, window_s=60.0)
    # A week of failures an hour apart: each window holds one.
    assert all(budget.spend(hour * 3600.0) for hour in range(24 * 7))


def test_failures_close_together_exhaust_it():
    budget = ResetBudget(limit=2, window_s=60.0)
    assert budget.spend(0.0) and budget.spend(10.0)
    assert not budget.spend(20.0)
    assert budget.recent == 3


def test_a_failure_leaves_the_window_after_window_seconds():
    budget = ResetBudget(limit=1, window_s=60.0)
    assert budget.spend(0.0)
    assert not budget.spend(59.9)
    assert budget.spend(120.0)  # both earlier ones are older than the window


def test_zero_allows_no_re_formation():
    assert not ResetBudget(limit=0, window_s=60.0).spend(0.0)


class _Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_reads_an_injected_clock_when_not_told_the_time():
    clock = _Clock()
    budget = ResetBudget(limit=1, window_s=60.0, clock=clock)
    assert budget.spend()
    clock.now += 30.0
    assert not budget.spend()
    clock.now += 61.0
    assert budget.spend()


def test_the_agent_counts_a_failed_round_once_however_many_workers_report_it():
    failures = RoundFailures(ResetBudget(limit=1, window_s=60.0, clock=_Clock()))
    assert failures.spend(3) is True
    # The round's other workers (and a stale report of an older round) say the same.
    assert failures.spend(3) is None and failures.spend(2) is None
    assert failures.budget.recent == 1
    assert failures.spend(4) is False  # a second round within the window: over


def test_the_agent_budget_of_unreachable_rounds_is_per_window():
    """A network that fails once an hour must not fail a week-long job at its
    (max_resets + 1)-th hour: rounds older than --reset-window no longer count."""
    clock = _Clock()
    failures = RoundFailures(ResetBudget(limit=2, window_s=3600.0, clock=clock))
    for round_number in range(1, 24 * 7):
        assert failures.spend(round_number) is True, round_number
        clock.now += 3600.0
    # Three within an hour are one too many.
    assert failures.spend(1000) is True and failures.spend(1001) is True
    clock.now += 10.0
    assert failures.spend(1002) is False
    assert failures.recent == 3


class _FakeAgent:
    """What ``Agent._on_network_failure`` touches, recording what it would write to etcd."""

    def __init__(self, max_resets: int, window_s: float, clock):
        self.config = SimpleNamespace(max_resets=max_resets, reset_window=window_s)
        self._network_failures = RoundFailures(ResetBudget(max_resets, window_s, clock=clock))
        self._plan = None
        self.events = SimpleNamespace(emit=lambda *a, **k: None)
        self.written: list[str] = []
        self.statuses: list = []
        self.participant = SimpleNamespace(set_status=self.statuses.append,
                                           control=SimpleNamespace(request_reset=lambda *args: None))
        self._etcd_writes = SimpleNamespace(write=lambda what, write: (self.written.append(what), write()))

    def fail_round(self, round_number: int, workers: int = 2) -> None:
        self._plan = SimpleNamespace(round=round_number)
        for w in range(workers):
            Agent._on_network_failure(self, f"m.w{w}", f"round {round_number}: could not connect")


def test_the_agent_fails_the_job_only_when_unreachable_rounds_crowd_one_window():
    clock = _Clock()
    agent = _FakeAgent(max_resets=1, window_s=60.0, clock=clock)
    for round_number in range(1, 6):  # five failed rounds, two minutes apart: retried each time
        agent.fail_round(round_number)
        clock.now += 120.0
    assert agent.written == [f"ask for a round after {r}" for r in range(1, 6)]
    agent.fail_round(6)
    clock.now += 5.0
    agent.fail_round(7)  # the second within a minute
    assert agent.written[-2:] == ["ask for a round after 6", "report the job failed"]
    (failed,) = agent.statuses
    assert failed.state == "failed"
    assert failed.reason == ("round 7: could not connect (2 rounds within 60s, --max-resets 1 per --reset-window)")
