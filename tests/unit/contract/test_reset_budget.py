"""--max-resets is a budget per --reset-window, not over the process's life."""

from elastic.contract.reset_budget import ResetBudget


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


def test_counting_a_spend_ahead_spends_nothing():
    budget = ResetBudget(limit=2, window_s=60.0)
    assert budget.count_if_spent(0.0) == 1
    budget.spend(0.0)
    budget.spend(10.0)
    assert budget.count_if_spent(20.0) == 3 and budget.count_if_spent(20.0) == 3  # asked twice: the same
    assert budget.count_if_spent(65.0) == 2  # the first has left the window
    assert budget.spend(20.0) is False and budget.recent == 3  # what it said spending would do
