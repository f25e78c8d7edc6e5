"""When the coordinator writes its waiting notice (waiting.notice_due), as a table."""

from __future__ import annotations

import pytest

from elastic.rendezvous.waiting import notice_due

I = 5.0  # the interval


@pytest.mark.parametrize("case, present, published, published_at, since, now, due", [
    ("nothing changed", 2, 2, 0.0, 0.0, 100.0, False),
    ("no wait, no notice", None, None, 0.0, None, 100.0, False),
    ("a wait younger than the interval", 2, None, 0.0, 98.0, 100.0, False),
    ("a wait of an interval: the first notice", 2, None, 0.0, 95.0, 100.0, True),
    ("a new count within the interval of the last", 3, 2, 97.0, 50.0, 100.0, False),
    ("a new count an interval after the last", 3, 2, 95.0, 50.0, 100.0, True),
    ("the wait ended: the notice goes at once", None, 3, 99.9, None, 100.0, True),
    ("a new leader does not know what is there", None, -1, 0.0, None, 100.0, True),
    ("a new leader, a wait of an interval", 2, -1, 0.0, 90.0, 100.0, True),
])
def test_notice_due(case, present, published, published_at, since, now, due):
    assert notice_due(present, published, published_at, since, now, interval=I) is due
