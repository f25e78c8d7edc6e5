"""A collective before @elastic.run on a worker that joins a job under way: one line that says
to move it, instead of torch's "call init_process_group" (the script did call elastic.init())."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elastic.contract.faults import USER
from elastic.worker import failures, pre_train

NO_GROUP = ValueError("Default process group has not been initialized, please make sure to call "
                      "init_process_group.")


def torchs_own_error():
    """What torch raises for a barrier with no process group (none exists in this test process)."""
    assert not dist.is_initialized()
    try:
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 (whatever torch raises, it is the case to explain)
        return exc
    raise AssertionError("a barrier without a process group did not raise")


@pytest.mark.parametrize("error, joining, explained", [
    (NO_GROUP, 4, True),  # a joiner or a replacement, before its first sync
    (RuntimeError("Default process group has not been initialized"), 2, True),
    (NO_GROUP, None, False),  # in its ring already (round 1, or after run entered): torch's own error
    (ValueError("shapes do not match"), 4, False),  # any other error stays itself
    (RuntimeError("Connection closed by peer"), 4, False),
])
def test_only_torchs_no_group_error_on_a_worker_not_yet_in_its_ring_is_explained(error, joining, explained):
    result = pre_train.explain(error, joining)
    assert (result is not error) == explained
    if explained:
        line = failures.summarize(result)
        assert line.startswith("NoRingBeforeRun: a collective before @elastic.run") and "\n" not in line
        assert f"(round {joining})" in line and "move it into the @elastic.run function" in line
        assert line == f"NoRingBeforeRun: {result}"  # whole: not cut at summarize's 300 characters
        assert failures.classify(result).kind == USER  # the job fails once, with that line


def test_torchs_real_message_is_the_one_recognised_and_the_line_names_the_users_call():
    error = torchs_own_error()  # raised in torch, called from here: this file is "the script"
    line = str(pre_train.explain(error, 3))
    assert line.startswith("a collective before @elastic.run (test_pre_train.py:")
    assert len(failures.summarize(pre_train.NoRingBeforeRun(line))) < 300  # never cut


def test_no_session_yet_leaves_the_error_alone():
    assert pre_train.explain(NO_GROUP, None) is NO_GROUP
