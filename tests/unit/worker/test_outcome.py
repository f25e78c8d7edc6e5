"""How a run of the training function ended, as one value (elastic/worker/outcome.py):
each interruption, the ring's faults, and what is raised on, without processes."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elastic.contract.errors import (HostsUpdatedInterrupt, JobStopping, LeftJob, PeerDataInvalid,
                                     PeersUnreachable)
from elastic.contract.faults import NETWORK, RING
from elastic.worker.outcome import Broken, Finished, Leave, Stop, Switch, outcome_of
from elastic.worker.ring_abort import RingBroken


def HEALTHY():  # noqa: N802 - the ring the body ran on is not broken
    return None


def _raising(exc):
    def body():
        raise exc
    return body


@pytest.mark.parametrize("exc, kind", [
    (JobStopping("job stops after commit 7"), Stop),
    (HostsUpdatedInterrupt("ring changes after commit 7"), Switch),
    (LeftJob("withdrawn from round 4 (graceful leave)"), Leave),
    (RingBroken("the ring was aborted"), Broken),
    (dist.DistBackendError("Connection closed by peer"), Broken),
])
def test_each_interruption_is_its_own_outcome(exc, kind):
    outcome = outcome_of(HEALTHY, _raising(exc))
    assert type(outcome) is kind
    assert outcome.reason


def test_a_return_value_is_carried_by_finished():
    assert outcome_of(HEALTHY, lambda a, b: a + b, 2, 3) == Finished(5)
    assert outcome_of(HEALTHY, lambda: None) == Finished(None)  # a function that returns nothing finished too


def test_a_broken_ring_carries_its_fault_and_rolls_back_a_switch_does_not():
    broken = outcome_of(HEALTHY, _raising(RingBroken("the ring was aborted")))
    assert broken.fault.kind == RING and broken.failed and not broken.alone and broken.unreachable is None
    assert not outcome_of(HEALTHY, _raising(HostsUpdatedInterrupt("x"))).failed


def test_a_bad_value_only_this_worker_saw_is_a_ring_fault_it_must_tell_the_peers_of():
    broken = outcome_of(HEALTHY, _raising(PeerDataInvalid("switch_at in the round's store is malformed")))
    assert broken.fault.kind == RING and broken.alone


def test_unreachable_peers_are_kept_without_their_traceback():
    error = PeersUnreachable(3, ["10.0.0.1"], "RuntimeError: Connect timeout")
    broken = outcome_of(HEALTHY, _raising(error))
    assert broken.fault.kind == NETWORK
    assert isinstance(broken.unreachable, PeersUnreachable) and broken.unreachable is not error
    assert broken.unreachable.__traceback__ is None


@pytest.mark.parametrize("exc", [ValueError("a bug in the loop"), ZeroDivisionError()])
def test_a_users_error_is_raised_on_not_turned_into_an_outcome(exc):
    with pytest.raises(type(exc)):
        outcome_of(HEALTHY, _raising(exc))
