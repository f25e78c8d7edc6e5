"""One plan per round through real elections: racing round transactions, candidates
racing for the coordinator key, and a coordinator deposed at the exact moment before it
writes the round it decided (a fault injected into its etcd client)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from elastic.rendezvous import JobKeys, RendezvousSettings
from elastic.rendezvous.etcd import CreateRevisionEquals, ModRevisionEquals, Put
from tests.fakes.local_members import PlanCounting, has_workers, rounds_in_etcd, worker
from tests.fakes.waiting import poll as wait_until

pytestmark = pytest.mark.timeout(60)


def test_racing_round_transactions_have_exactly_one_winner(etcd, job_id):
    keys = JobKeys(job_id)
    contenders = 8
    barrier = threading.Barrier(contenders)
    results: list[tuple[int, bool]] = []
    lock = threading.Lock()

    def contend(index: int) -> None:
        body = json.dumps({"writer": index}).encode()
        barrier.wait(timeout=5)
        # The shape of Coordinator._write_plan's txn: the plan key has not moved and the round is new.
        won, _ = etcd.txn(
            [ModRevisionEquals(keys.plan, 0), CreateRevisionEquals(keys.round(1), 0)],
            [Put(keys.plan, body), Put(keys.round(1), body)],
        )
        with lock:
            results.append((index, won))

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    winners = [index for index, won in results if won]
    assert len(results) == contenders and len(winners) == 1
    assert json.loads(etcd.get(keys.round(1)).value) == {"writer": winners[0]}
    assert etcd.get(keys.plan).value == etcd.get(keys.round(1)).value


def test_candidates_racing_for_the_election_elect_one_coordinator_per_term(local, etcd):
    """Real elections: four members start at once, then the leader is deposed three times
    (its election key deleted) while a member joins; every round has exactly one writer."""
    settings = RendezvousSettings(1, 16, settle=0.1, timeout=30)
    names = ["a", "b", "c", "d"]
    barrier = threading.Barrier(len(names))

    def start(name: str) -> None:
        barrier.wait(timeout=10)
        local.add(name, settings)

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        list(pool.map(start, names))
    local.wait_for_plan("a", lambda p: set(p.worker_ids()) == {worker(m) for m in names}, timeout=15)
    assert wait_until(local.leader, 10), "not exactly one coordinator"

    for joiner in ["e", "f", "g"]:
        deposed = local.leader()
        assert deposed is not None
        # The followers, watching the key, campaign at once; the deposed leader too.
        etcd.delete(local.keys.coordinator)
        local.add(joiner, settings)
        names.append(joiner)
        local.wait_for_plan("a", lambda p: set(p.worker_ids()) == {worker(m) for m in names}, timeout=15)
        assert wait_until(local.leader, 10), "not exactly one coordinator after the deposition"
        holder = etcd.get(local.keys.coordinator)
        assert holder is not None and holder.value.decode() in local.by_id

    rounds = rounds_in_etcd(etcd, local.keys)
    assert sorted(rounds) == list(range(1, len(rounds) + 1))
    assert all(plan.round == number for number, plan in rounds.items())
    # Every plan in etcd was written by exactly one coordinator (a round two writers both
    # counted would make the sum exceed the rounds; a lost write would not be in etcd).
    # A writer counts its round when its transaction call returns, a moment after etcd has it.
    assert wait_until(lambda: sum(p.etcd.rounds_written for p in local.by_id.values()) == len(rounds), 5)


class PlanWriteHook(PlanCounting):
    """An etcd client that runs ``before_plan_write`` (once) just before its next
    transaction that writes a round plan: a fault injected at the exact point."""

    def __init__(self, config, keys: JobKeys):
        super().__init__(config, keys)
        self.before_plan_write = None
        self.plan_writes: list[bool] = []  # what each hooked transaction returned

    def txn(self, compare, success, failure=()):
        hook = self.before_plan_write
        if hook is None or not any(isinstance(op, Put) and op.key.startswith(self._rounds_prefix) for op in success):
            return super().txn(compare, success, failure)
        self.before_plan_write = None
        hook()
        won, revision = super().txn(compare, success, failure)
        self.plan_writes.append(won)
        return won, revision


@pytest.mark.parametrize("deposition", ["lease revoked", "election key deleted"])
def test_deposed_coordinator_cannot_write_the_round_it_decided(local, etcd, etcd_server, deposition):
    """Coordinator a decides the round that admits c; just before its transaction it is
    deposed and b or c wins the election. a's write must fail on its fencing token alone:
    the others' plan writes are held back until a has tried, so the plan key and the round
    key are still as a read them."""
    # No recovery hold: c's join round comes at once after the survivors' round, before
    # a's member (its session re-registers after the lease is revoked) is back.
    settings = RendezvousSettings(1, 8, settle=0.1, timeout=30, recovery_hold=0.0)
    clients = {name: PlanWriteHook(etcd_server.config(), local.keys) for name in "abc"}
    a = local.add("a", settings, etcd=clients["a"])
    local.wait_for_plan("a", has_workers("a/w0"))
    local.add("b", settings, etcd=clients["b"])
    before = local.wait_for_plan("b", has_workers("a/w0", "b/w0"))
    assert local.leader() is a and wait_until(lambda: a.etcd.rounds_written == before.round, 5)
    a_tried = threading.Event()
    new_leader: list[str] = []

    def depose_a() -> None:
        if deposition == "lease revoked":
            etcd.revoke_lease(a.session.lease_id)  # a's member key goes with it
        else:
            etcd.delete(local.keys.coordinator)
        # a's thread is held here: whoever wins now campaigned against a live, blocked a.
        winner = wait_until(lambda: [m for m in "bc" if m in local.by_id and local.by_id[m].coordinator
                                     and local.by_id[m].coordinator.leading.is_set()], 10)
        new_leader.extend(winner)

    def hold_until_a_tried() -> None:
        a_tried.wait(10)

    clients["a"].before_plan_write = depose_a
    clients["b"].before_plan_write = clients["c"].before_plan_write = hold_until_a_tried
    local.add("c", settings, etcd=clients["c"])
    assert wait_until(lambda: clients["a"].plan_writes, 15), "a never tried to write the round with c"
    a_tried.set()
    assert len(new_leader) == 1, f"not exactly one of b, c won the election: {new_leader}"
    assert clients["a"].plan_writes == [False]
    assert a.etcd.rounds_written == before.round

    survivors = ("b/w0", "c/w0") if deposition == "lease revoked" else ("a/w0", "b/w0", "c/w0")
    # With a's lease revoked, a is lost: the survivors re-form first (b alone is enough for
    # min_np=1) and c, a newcomer, joins in the round after (rounds.decide).
    written = 2 if deposition == "lease revoked" else 1
    after = local.wait_for_plan("c", has_workers(*survivors))
    assert after.round == before.round + written
    # (The plan is visible in etcd a moment before the writer's transaction call returns.)
    writes = wait_until(lambda: clients[new_leader[0]].plan_writes, 5)
    assert writes and all(writes), writes  # (every round by one writer: checked below)
    rounds = rounds_in_etcd(etcd, local.keys)
    assert rounds[after.round].worker_ids() == survivors
    assert sorted(rounds) == list(range(1, after.round + 1))
    assert wait_until(lambda: sum(p.etcd.rounds_written for p in local.by_id.values()) == len(rounds), 5)
    # a does not lead again while the winner holds the key (a re-campaigns once deposed).
    assert etcd.get(local.keys.coordinator).value.decode() == new_leader[0]
    assert not a.coordinator.leading.is_set()
