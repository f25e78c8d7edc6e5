"""The coordinator: one elected agent turns membership into round plans.

Every agent runs a ``Coordinator``; the one whose session holds the
``coordinator`` key (etcd election: create it if absent, bound to our lease)
leads. Only the leader watches the members prefix, so a join or a loss costs
one event, not one per member. The others watch the single election key and
campaign again when it disappears (the leader left or its lease expired).

Leading is a loop: take a view of what is known, ask the pure ``decide``
what to do, apply it. A plan is written with one transaction that checks (a) the
plan key has not moved since we read it, (b) round n was never written, and (c)
we still hold the election key: two writers can never both win a round. The
job's status is written the same way (``ControlChannel.set_status``): a Fail
decision is fenced by the election key, and an ended job is never re-ended.

Members cut off from their peers while they still reach etcd (their lease lives
on) are planned without, from the agents' reachability reports (reachability.py):
the leader follows the ``reach/`` prefix too and leaves the excluded members out
of the view, so ``decide`` sees their workers gone, as after a loss.

After a compaction (or a watch that cannot resume) the members, requests and reach
prefixes are loaded again and the view rebuilt, and the election key is checked
again, so a delete can never be lost.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from .control import FAILED, RUNNING, STOPPING, ControlChannel, JobStatus
from .errors import MalformedValueError, RendezvousError
from .etcd import CreateRevisionEquals, Delete, ModRevisionEquals, Put
from .election import Election
from .job_lease import JobLease, lease_missing
from .keys import KEEP_ROUNDS, JobKeys
from .kv import Kv
from .liveness import evict_dead_members
from .reachability import ReachReport, exclusions
from .rounds import (
    Fail,
    FormRound,
    Member,
    ProbeLiveness,
    RendezvousSettings,
    ResetRequest,
    RoundPlan,
    CoordinatorView,
    StopJob,
    Wait,
    candidate_count,
    decide,
)
from .session import Session
from .skipped import SkippedKeys
from .waiting import WaitingEcho, WaitingLine, WaitingNotice, notice_due

log = logging.getLogger(__name__)

RoundListener = Callable[[RoundPlan, str], None]

STEP_REST_FACTOR = 2.0  # after a step, rest twice what it cost (_step)


class Coordinator:
    def __init__(
        self,
        etcd: Kv,
        keys: JobKeys,
        session: Session,
        settings: RendezvousSettings,
        member_id: str,
        control: ControlChannel,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_round: Optional[RoundListener] = None,
    ):
        self._etcd = etcd
        self._keys = keys
        self._session = session
        self._settings = settings
        self._member_id = member_id
        self._control = control
        self._clock = clock
        self._on_round = on_round
        self._stop = threading.Event()
        self._wake = threading.Condition()
        self._skipped = SkippedKeys("coordinator")
        self._job_lease = JobLease(etcd, keys, settings.abandoned_after, self._clock)
        self._election = Election(etcd, keys.coordinator, member_id, session)
        self._thread: Optional[threading.Thread] = None
        self.leading = threading.Event()
        # leader state, touched only under self._wake
        self._members: dict[str, Member] = {}
        self._requests: dict[str, ResetRequest] = {}
        self._request_revisions: dict[str, int] = {}  # worker id -> mod revision of its request key
        self._reports: dict[str, ReachReport] = {}  # member id -> its reachability report
        self._excluded: frozenset = frozenset()  # members left out for being unreachable
        self._probed: tuple[int, frozenset] = (0, frozenset())  # (round, members whose agents answered)
        self._last_change = clock()
        self._below_min_since: Optional[float] = None
        self._plan_seen: tuple[int, float] = (0, 0.0)  # (round, when we first saw its plan)
        self._formed_round = 0  # the newest round a worker of this host reported training (ring_formed)
        self._waiting = WaitingLine(settings.min_np)
        self._waiting_published: Optional[int] = None  # the count of the notice in etcd (waiting.py)
        self._waiting_published_at = 0.0
        self._waiting_echo = WaitingEcho()  # the leader's line, shown while we do not lead
        self._rest_until = 0.0  # time.monotonic(): no step before (see _step)
        self._dirty = False

    def start(self) -> "Coordinator":
        self._thread = threading.Thread(target=self._run, name="elastic-coordinator", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- election -----------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._session.lost.is_set():
                # Cut off from etcd: nothing to lead or campaign for until the
                # session comes back (on a new lease), then campaign again.
                self.leading.clear()
                self._stop.wait(0.5)
                continue
            if self._control.status.over:
                # The job ended: nothing left to decide, and taking over from the leader
                # that just left would only put a confusing line at the end of the log.
                self._stop.wait(0.5)
                continue
            try:
                revision = self._election.campaign()
                if revision is None:
                    self._election.wait_for_vacancy(
                        self._stop, lambda: self._waiting_echo.tick(*(self._control.waiting or (None, 0.0))))
                else:
                    self._lead(revision)
            except RendezvousError as exc:
                log.warning("coordinator: %s; retrying", exc)
                self._stop.wait(0.5)
            except Exception:
                log.exception("coordinator: unexpected error; retrying")
                self._stop.wait(0.5)
        self.leading.clear()

    def _publish_waiting(self, token: int, notice: Optional[WaitingNotice], now: float) -> None:
        """Tell the other agents of a wait below min_np (waiting.py). Only once it has
        lasted an interval, then when the count changes, at most once an interval: a
        rendezvous that completes at once never writes it, and arrivals during a long
        wait cost every agent one event per interval, not one per arrival (O(N) per
        interval, never O(N^2)). When the wait ends, the key goes."""
        count = None if notice is None else notice.present
        if not notice_due(count, self._waiting_published, self._waiting_published_at, self._below_min_since, now):
            return  # the next turn (at least every second) looks again
        key, fence = self._keys.waiting, CreateRevisionEquals(self._keys.coordinator, token)
        action = Delete(key) if notice is None else Put(key, notice.to_json(), lease=self._session.lease_id)
        try:
            written, _ = self._etcd.txn([fence], [action])
        except RendezvousError as exc:
            log.debug("coordinator: waiting notice not written (%s)", exc)
            return
        if written:
            self._waiting_published, self._waiting_published_at = count, now

    # -- leading ------------------------------------------------------------
    def _lead(self, token: int) -> None:
        log.info("coordinator: %s leads (token %d)", self._member_id, token)
        # A previous term's view is stale: the below-min clock starts afresh.
        self._below_min_since = None
        self._waiting_published = -1  # unknown: a notice of an earlier leader may be there
        self.leading.set()
        deposed = threading.Event()

        def on_deposed():
            deposed.set()
            with self._wake:
                self._wake.notify_all()

        watches = []
        try:
            self._job_lease.take()  # plans and rounds go on it (job_lease.py)
            watches.append(self._follow(self._keys.members, self._on_member_events))
            watches.append(self._follow(self._keys.requests, self._on_request_events))
            watches.append(self._follow(self._keys.reach, self._on_reach_events))
            watches.append(self._election.watch_deposed(token, on_deposed))
            while not (self._stop.is_set() or deposed.is_set() or self._session.lost.is_set()):
                if self._control.status.state != RUNNING:  # no new rounds once stopping
                    self._stop.wait(0.5)
                    continue
                self._job_lease.keep()
                self._step(token)
        finally:
            for watch in watches:
                watch.cancel()
            self.leading.clear()
            log.info("coordinator: %s stops leading", self._member_id)

    def _follow(self, prefix: str, handler):
        """Load a prefix and follow it. After a compaction or a broken watch that
        cannot resume, load it again and rebuild the view: a lost delete would
        otherwise keep a member (or a request) in it for ever."""

        def load() -> int:
            kvs, revision = self._etcd.get_prefix(prefix)
            handler([("put", kv) for kv in kvs], initial=True)
            return revision  # the watch resumes right after what we read

        revision = load()
        return self._etcd.watch(
            prefix,
            prefix=True,
            start_revision=revision + 1,
            on_events=lambda events: handler([(e.type, e.kv) for e in events]),
            on_reset=load,
        )

    def ring_formed(self, round_number: int) -> None:
        """A worker of this host reports the ring of ``round_number`` re-formed and
        training: the hold before a join round (``rounds.decide``) may end now."""
        with self._wake:
            if round_number > self._formed_round:
                self._formed_round = round_number
                self._dirty = True
                self._wake.notify_all()

    def _on_member_events(self, events, initial: bool = False) -> None:
        with self._wake:
            if initial:
                self._members.clear()
            for kind, kv in events:
                member_id = kv.key[len(self._keys.members):]
                member = self._parsed(kv, lambda: Member.from_json(kv.value, kv.create_revision)) \
                    if kind == "put" else None
                if member is not None:
                    self._members[member_id] = member
                else:
                    self._members.pop(member_id, None)  # gone, or unreadable: not a member
            self._last_change = self._clock()
            self._dirty = True
            self._wake.notify_all()

    def _on_request_events(self, events, initial: bool = False) -> None:
        with self._wake:
            self._requests, changes = self._merged(self._requests, events, initial, self._keys.requests,
                                                   lambda worker, value: ResetRequest.from_json(worker, value,
                                                                                                self._clock()))
            if initial:
                self._request_revisions = {}
            for worker_id, _, request, kv in changes:
                if request is not None:
                    self._request_revisions[worker_id] = kv.mod_revision
                else:
                    self._request_revisions.pop(worker_id, None)
            self._dirty = True
            self._wake.notify_all()
        for _, kind, request, kv in changes:
            if kind == "put" and kv.value and request is None:  # unreadable: requests carry no lease, so delete it
                try:
                    self._etcd.delete(kv.key)
                except RendezvousError as exc:
                    log.debug("coordinator: malformed request %s not deleted (%s)", kv.key, exc)

    def _on_reach_events(self, events, initial: bool = False) -> None:
        with self._wake:
            now = self._clock()
            self._reports, _ = self._merged(self._reports, events, initial, self._keys.reach,
                                            lambda member, value: ReachReport.from_json(member, value, now))
            self._dirty = True
            self._wake.notify_all()

    def _merged(self, table: dict, events, initial: bool, prefix: str, parse) -> tuple[dict, list]:
        """``table`` (requests or reach reports, by the name after ``prefix``) after ``events``,
        and (name, kind, parsed or None, kv) per event. A reload (``initial``) starts afresh but
        keeps the copy first seen of an entry for the same round: when it was first seen
        is what the rules (rounds.decide, reachability.exclusions) time from."""
        merged = {} if initial else table
        changes = []
        for kind, kv in events:
            name = kv.key[len(prefix):]
            item = self._parsed(kv, lambda: parse(name, kv.value)) if kind == "put" and kv.value else None
            if item is not None:
                seen = table.get(name)
                if initial and seen is not None and seen.round == item.round:
                    item = seen  # a reload keeps when we first saw it
                merged[name] = item
            else:
                merged.pop(name, None)
            changes.append((name, kind, item, kv))
        return merged, changes

    def _renew_until(self) -> Optional[float]:
        """After our own refreshes failed (etcd away), the members get one TTL from when
        ours got through again to renew theirs (rounds.decide)."""
        back_at = getattr(self._session, "back_at", None)
        if back_at is None:
            return None
        # In the coordinator's clock: the session keeps time.monotonic().
        return self._clock() + (back_at + self._session.ttl - time.monotonic())

    def _parsed(self, kv, parse):
        """``parse()``, or None for a value that does not parse (named once: skipped.py)."""
        try:
            return parse()
        except MalformedValueError as exc:
            self._skipped.skip(kv.key, kv.value, exc)
            return None

    def _reachable_members(self, plan, now: float):
        """The registered members minus those cut off from the ring (under ``_wake``);
        and when to decide again if reports are still awaited."""
        members = tuple(self._members.values())
        exclusion = exclusions(plan, tuple(self._members), self._reports, now)
        if exclusion.members != self._excluded:
            if exclusion.members - self._excluded:
                log.warning("coordinator: excluding %s (%s)", ", ".join(sorted(exclusion.members - self._excluded)),
                            exclusion.reason or "cannot reach the ring, or the ring cannot reach them")
            if self._excluded - exclusion.members:
                log.warning("coordinator: %s reachable again", ", ".join(sorted(self._excluded - exclusion.members)))
            self._excluded = exclusion.members
        elif exclusion.reason and not exclusion.members:
            log.debug("coordinator: %s", exclusion.reason)
        return tuple(m for m in members if m.member_id not in exclusion.members), exclusion.recheck_at

    def _step(self, token: int) -> None:
        # A step costs O(members) (about 2 ms at 4096): stepping on every event of a
        # flood of arrivals would cost O(N^2) CPU in all. So rest STEP_REST_FACTOR times
        # what the last step cost; the events of the rest are taken in one step. At most
        # a third of a core goes to stepping, for a delay of a few ms at thousands of
        # members and microseconds at tens.
        rest = self._rest_until - time.monotonic()
        if rest > 0:
            self._stop.wait(rest)
        started = time.monotonic()
        now = self._clock()
        with self._wake:
            plan = self._control.plan
            members, recheck_at = self._reachable_members(plan, now)
            present = min(candidate_count(members), self._settings.max_np)
            notice = None
            if present < self._settings.min_np:
                if self._below_min_since is None:
                    self._below_min_since = now
                notice = WaitingNotice(present, self._settings.min_np, self._below_min_since + self._settings.timeout - now)
                self._waiting.report(present, notice.fails_in, now)
            else:
                self._below_min_since = None
                self._waiting.reset()
            if plan is not None and plan.round != self._plan_seen[0]:
                self._plan_seen = (plan.round, now)
            view = CoordinatorView(
                plan=plan,
                members=members,
                requests=tuple(self._requests.values()),
                last_change=self._last_change,
                below_min_since=self._below_min_since,
                plan_seen_at=self._plan_seen[1] if plan is not None else None,
                plan_formed=plan is not None and self._formed_round >= plan.round,
                renew_until=self._renew_until(),
                excluded=self._excluded,
                probed=self._probed[1] if plan is not None and self._probed[0] == plan.round else frozenset(),
                leader=self._member_id,
            )
            self._dirty = False
        decision = decide(view, self._settings, now)
        # The rest follows the step's computing, not the etcd round trip of the notice.
        self._rest_until = time.monotonic() + STEP_REST_FACTOR * (time.monotonic() - started)
        self._publish_waiting(token, notice, now)
        self._apply(token, plan, members, decision, now, recheck_at)

    def _apply(self, token: int, plan, members, decision, now: float, recheck_at: Optional[float]) -> None:
        """Carry out ``decide``'s decision: every rule is in ``decide``, none here."""
        if isinstance(decision, ProbeLiveness):
            self._probe(plan, decision.members)
            return
        if isinstance(decision, FormRound):
            self._write_plan(token, plan, members, decision)
            return
        if isinstance(decision, StopJob):
            if self._control.set_status(JobStatus(STOPPING, decision.reason), fence=(self._keys.coordinator, token)):
                log.info("coordinator: job stops at a commit: %s", decision.reason)
            else:
                self._stop.wait(0.5)
            return
        if isinstance(decision, Fail):
            # Fenced by our election token: a deposed coordinator cannot fail the job.
            if self._control.set_status(JobStatus(FAILED, decision.reason), fence=(self._keys.coordinator, token)):
                log.error("coordinator: job failed: %s", decision.reason)
            else:
                self._stop.wait(0.5)  # deposed, or the job already ended: our watches will say so
            return
        if not isinstance(decision, Wait):
            raise TypeError(f"coordinator: no way to apply {decision!r}")
        with self._wake:
            if self._dirty:
                return
            timeout = 1.0 if decision.until is None else max(0.0, min(1.0, decision.until - now))
            if recheck_at is not None:
                timeout = max(0.0, min(timeout, recheck_at - now))
            self._wake.wait(timeout)

    def _delete_answered_requests(self, number: int) -> None:
        """Requests for rounds before ``number`` are answered: delete them, each only if
        it was not re-posted meanwhile (its mod revision is the one we saw)."""
        with self._wake:
            answered = [
                (worker, self._request_revisions[worker])
                for worker, request in self._requests.items()
                if request.round < number and worker in self._request_revisions
            ]
        for worker, revision in answered:
            key = self._keys.request(worker)
            try:
                self._etcd.txn([ModRevisionEquals(key, revision)], [Delete(key)])
            except RendezvousError as exc:  # harmless: deleted with a later round
                log.debug("coordinator: could not delete request %s: %s", worker, exc)
                return

    def _probe(self, plan, member_ids: tuple[str, ...]) -> None:
        """A ring broke and nobody said why: revoke the leases of the members whose
        agents are dead; the others are ``probed`` for the rest of this plan's round."""
        evicted = evict_dead_members(self._etcd, self._keys, member_ids)
        alive = frozenset(member_ids) - frozenset(evicted)
        with self._wake:
            known = self._probed[1] if self._probed[0] == plan.round else frozenset()
            self._probed = (plan.round, known | alive)
            # Wait (bounded, in real time) for our members watch to drop the evicted, so
            # the next decision does not see them again and probe twice.
            deadline = time.monotonic() + 2.0
            while any(m in self._members for m in evicted) and time.monotonic() < deadline:
                self._wake.wait(0.05)

    def _write_plan(self, token, previous, members, decision: FormRound) -> None:
        by_id = {m.member_id: m for m in members}
        number = 1 if previous is None else previous.round + 1
        first = by_id[decision.slots[0].member_id]
        plan = RoundPlan(
            round=number,
            slots=decision.slots,
            hosts={s.member_id: (by_id[s.member_id].host, by_id[s.member_id].addr) for s in decision.slots},
            store_addr=f"{first.addr}:{first.store_port}",
            created=time.time(),
            lost=decision.lost,
            reason=decision.reason,
            recovers=decision.recovers,
        )
        plan_kv = self._etcd.get(self._keys.plan)
        stored = self._parsed(plan_kv, lambda: RoundPlan.from_json(plan_kv.value)) if plan_kv is not None else None
        if stored is not None and stored.round != (number - 1):
            return  # our view is stale; the control watch will catch up
        # (An unreadable plan is replaced by this one: the transaction still fences it.)
        body = plan.to_json()

        def write(lease):
            return self._etcd.txn(
                [
                    ModRevisionEquals(self._keys.plan, 0 if plan_kv is None else plan_kv.mod_revision),
                    CreateRevisionEquals(self._keys.round(number), 0),
                    CreateRevisionEquals(self._keys.coordinator, token),
                ],
                [Put(self._keys.plan, body, lease=lease), Put(self._keys.round(number), body, lease=lease)]
                + ([Delete(self._keys.round(number - KEEP_ROUNDS))] if number > KEEP_ROUNDS else []),
            )[0]

        try:
            won = write(self._job_lease.id)
        except RendezvousError as exc:
            if not lease_missing(exc):
                raise
            won = write(self._job_lease.take())  # the job lease went (expired): a new one
        if not won:
            log.warning("coordinator: lost the race for round %d", number)
            return
        self._delete_answered_requests(number)
        log.info(
            "coordinator: round %d formed, world size %d (%s)", number, plan.world_size, decision.reason
        )
        # Wait until our own control watch has seen the plan, so the next decision
        # starts from it rather than from the round before.
        self._control.wait_for(lambda p, s: p is not None and p.round >= number, timeout=5.0)
        if self._on_round is not None:
            self._on_round(plan, decision.reason)
