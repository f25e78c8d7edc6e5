"""The agent's loop acts on a plan again when acting on it needed etcd and etcd failed."""

from types import SimpleNamespace

from elastic.agent.agent import Agent
from elastic.rendezvous.errors import RendezvousConnectionError, RendezvousTimeoutError


class _StandIn:
    """What ``Agent._follow_rounds`` touches."""

    def __init__(self, failure):
        self._plan_started, self._plan = SimpleNamespace(round=3), SimpleNamespace(round=4)
        self.failure = failure
        self.followed = 0

    def _restart_plain_workers(self):
        if self.failure is not None:
            raise self.failure  # a torchrun-style worker's store address could not be read

    def _follow_control(self):
        self.followed += 1

    def _start_awaiting(self):
        pass  # workers waiting for a device slot: none here


def test_a_failed_restart_of_a_plain_worker_leaves_the_plan_to_act_on_again():
    for failure in (RendezvousTimeoutError("round 4: no store published within 30s"),
                    RendezvousConnectionError("etcd at 10.0.0.5:2379 unreachable")):
        agent = _StandIn(failure)
        Agent._follow_rounds(agent)  # does not raise: the agent's loop goes on
        assert agent._plan.round == 3 and agent.followed == 0  # round 4 is acted on next turn


def test_without_failure_the_plan_is_followed():
    agent = _StandIn(None)
    Agent._follow_rounds(agent)
    assert agent._plan.round == 4 and agent.followed == 1
