"""The timeouts' combinations elastic-run refuses or warns about, as a table (contract/timeouts.py)."""

from __future__ import annotations

import pytest

from elastic.contract.timeouts import ERROR, WARNING, Timeouts, pause_threshold, review

DEFAULTS = dict(ttl=10.0, collective=60.0, rendezvous=600.0, settle=0.5, hang=None, nccl=False)

# (what differs from the defaults, the findings' (level, first words))
TABLE = [
    ({}, []),
    # Legitimate: a short rendezvous timeout to fail fast, detection off, a fixed hang timeout on gloo.
    (dict(rendezvous=30.0), []),
    (dict(hang=0.0, nccl=True), []),
    (dict(hang=8.0), []),
    (dict(ttl=3.0, collective=3.0), []),  # equal is no warning
    (dict(settle=60.0, rendezvous=600.0), []),
    # Cannot work: refused.
    (dict(settle=600.0), [(ERROR, "--rdzv-settle 600")]),
    (dict(settle=30.0, rendezvous=5.0), [(ERROR, "--rdzv-settle 30"), (WARNING, "--rdzv-timeout 5")]),
    # Suspicious: said once each.
    (dict(collective=5.0), [(WARNING, "--collective-timeout 5")]),
    (dict(rendezvous=5.0), [(WARNING, "--rdzv-timeout 5")]),
    (dict(hang=8.0, nccl=True), [(WARNING, "--hang-timeout 8 is below --collective-timeout"),
                                 (WARNING, "--hang-timeout 8 is below --rdzv-ttl")]),
    (dict(hang=30.0, nccl=True), [(WARNING, "--hang-timeout 30 is below --collective-timeout")]),
    (dict(hang=30.0, collective=3.0, nccl=True), [(WARNING, "--collective-timeout 3")]),  # the GPU checks' job
]


@pytest.mark.parametrize("change, expected", TABLE)
def test_review(change, expected):
    found = review(Timeouts(**{**DEFAULTS, **change}))
    assert [(level, line[:len(start)]) for (level, line), (_, start) in zip(found, expected)] == expected
    assert len(found) == len(expected)
    assert all("\n" not in line for _, line in found)  # one line each


def test_the_pause_threshold_is_a_quarter_of_the_ttl_so_always_below_it():
    assert pause_threshold(10.0) == 2.5
    assert Timeouts(**DEFAULTS).pause < DEFAULTS["ttl"]
