"""Rendezvous members in the test process, each with its own etcd client (as separate
hosts would have): cheaper than member processes where a test inspects a member's
internals (its watches, its coordinator, its request counter)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from elastic.rendezvous import Etcd, JobKeys, Member, Participant, RendezvousSettings, RoundPlan
from elastic.rendezvous.errors import RendezvousClosedError, RendezvousTimeoutError
from elastic.rendezvous.etcd import Put


def worker(member_id: str, index: int = 0) -> str:
    return f"{member_id}/w{index}"


def rounds_in_etcd(etcd: Etcd, keys: JobKeys) -> dict[int, RoundPlan]:
    kvs, _ = etcd.get_prefix(keys.prefix + "rounds/")
    return {int(kv.key.rsplit("/", 1)[1]): RoundPlan.from_json(kv.value) for kv in kvs}


class PlanCounting(Etcd):
    """An etcd client that counts the round plans its transactions wrote: a test that wants
    every round written by exactly one coordinator sums them over the members' clients."""

    def __init__(self, config, keys: JobKeys):
        super().__init__(config)
        self._rounds_prefix = keys.prefix + "rounds/"
        self.rounds_written = 0

    def txn(self, compare, success, failure=(), **kwargs):
        won, revision = super().txn(compare, success, failure, **kwargs)
        if won and any(isinstance(op, Put) and op.key.startswith(self._rounds_prefix) for op in success):
            self.rounds_written += 1
        return won, revision


class LocalMembers:
    """Participants in this process, each with its own etcd client (as separate hosts would have)."""

    def __init__(self, config, job_id: str):
        self._config = config
        self.keys = JobKeys(job_id)
        self.by_id: dict[str, Participant] = {}
        self._left: set[str] = set()

    def add(self, member_id: str, settings: RendezvousSettings, *, workers: int = 1, ttl: float = 5.0,
            etcd: Etcd | None = None) -> Participant:
        etcd = etcd or PlanCounting(self._config, self.keys)
        member = Member(member_id, "localhost", "127.0.0.1", 29500,
                        tuple(worker(member_id, i) for i in range(workers)), joined=time.time())
        participant = Participant(etcd, self.keys, settings, member, ttl=ttl)
        self.by_id[member_id] = participant
        participant.start()
        return participant

    def leave(self, member_id: str) -> None:
        self._left.add(member_id)
        participant = self.by_id[member_id]
        participant.leave()
        participant.etcd.close()

    def abandon(self, member_id: str) -> None:
        """As a SIGKILL of its agent leaves it: nothing said, nothing refreshed any more
        (its keys stay until their leases expire)."""
        self._left.add(member_id)
        participant = self.by_id[member_id]
        participant.coordinator.stop()
        participant.session.orphan()
        participant.control.close()

    def leader(self) -> Participant | None:
        leading = [p for m, p in self.by_id.items()
                   if m not in self._left and p.coordinator is not None and p.coordinator.leading.is_set()]
        return leading[0] if len(leading) == 1 else None

    def wait_for_plan(self, member_id: str, accept, timeout: float = 10.0) -> RoundPlan:
        """Block until ``member_id``'s control channel holds a plan that ``accept``s; raise if
        the job ends first."""
        control = self.by_id[member_id].control
        ok = control.wait_for(lambda plan, status: status.over or (plan is not None and accept(plan)), timeout)
        if control.status.over:
            raise RendezvousClosedError(f"job {control.status.state}: {control.status.reason}")
        if not ok:
            raise RendezvousTimeoutError(f"no round formed within {timeout:g}s")
        return control.plan

    def close(self) -> None:
        # In parallel: a coordinator may take up to half a second to notice its stop.
        remaining = [m for m in self.by_id if m not in self._left]
        with ThreadPoolExecutor(max_workers=max(1, len(remaining))) as pool:
            list(pool.map(self.leave, remaining))


def has_workers(*workers: str):
    return lambda plan: plan.worker_ids() == tuple(workers)
