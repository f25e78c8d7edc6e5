"""The agent's loop acts on a plan again when acting on it needed etcd and etcd failed."""

from elastic.agent.agent import AgentState, follow_rounds
from elastic.rendezvous import RoundPlan, Slot
from elastic.rendezvous.errors import RendezvousConnectionError, RendezvousTimeoutError


def _plan(number: int) -> RoundPlan:
    return RoundPlan(round=number, slots=(Slot("m", "m.w0"),), hosts={"m": ("m", "127.0.0.1")},
                     store_addr="127.0.0.1:1", created=0.0)


def _following(failure):
    state = AgentState(plan=_plan(4), previous_plan=_plan(3))  # round 4 just taken
    done = []

    def restart_plain_workers():
        if failure is not None:
            raise failure  # a torchrun-style worker's store address could not be read

    return state, done, (restart_plain_workers, lambda: done.append("followed"), lambda: done.append("awaiting"))


def test_a_failed_restart_of_a_plain_worker_leaves_the_plan_to_act_on_again():
    for failure in (RendezvousTimeoutError("round 4: no store published within 30s"),
                    RendezvousConnectionError("etcd at 10.0.0.5:2379 unreachable")):
        state, done, steps = _following(failure)
        follow_rounds(state, steps)  # does not raise: the agent's loop goes on
        assert state.plan.round == 3 and done == []  # round 4 is acted on next turn


def test_without_failure_the_plan_is_followed():
    state, done, steps = _following(None)
    follow_rounds(state, steps)
    assert state.plan.round == 4 and done == ["followed", "awaiting"]
