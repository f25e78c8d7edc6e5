"""T4 in the suite: 20 re-formations of a one-rank NCCL ring leak nothing measurable
(the 100-round run is ``python -m tests.gpu.reform_leaks``)."""

from __future__ import annotations

import pytest

from tests.gpu import reform_leaks
from tests.gpu.conftest import NEEDS_CUDA

pytestmark = [NEEDS_CUDA, pytest.mark.timeout(600)]


def test_twenty_reformations_leave_memory_threads_and_fds_flat():
    records = reform_leaks.run(20, 5e6)
    assert [r["left_by"] for r in records[:2]] == ["abort", "destroy"]
    assert reform_leaks.check(records) == [], reform_leaks.growth(records)
    assert max(r["leave_s"] for r in records) < 10.0
