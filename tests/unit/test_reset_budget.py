"""--max-resets is a budget per --reset-window, not over the process's life."""

from elastic.reset_budget import ResetBudget


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
