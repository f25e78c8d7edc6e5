"""The agent's peer probe: what counts as an answer, and when the ring looks stalled."""

import json

from elastic.agent.peer_probe import PeerProbe
from elastic.contract.progress import Marks
from elastic.rendezvous import Member
from elastic.rendezvous.liveness import REFUSED, SILENT


class _FakeParticipant:
    keys = None
    session = None
    control = None

    class member:
        member_id = "m"


def _probe():
    return PeerProbe(None, _FakeParticipant(), None, clock=lambda: 100.0)


def test_a_worker_without_a_commit_for_the_bound_marks_the_ring_stalled():
    probe = _probe()
    # The defaults the agent runs: probing 0.4 s into a stall; a peer silent to every
    # connect for 0.75 s (one every 0.25 s) is reported at once.
    assert (probe.floor, probe.timeout, probe.resend_every, probe.passes) == (0.4, 0.75, 0.25, 1)
    probe.floor = 1.0
    assert not probe.stalled([Marks(progress=5, progress_at=99.5, slowest=0.1, beats=9, alive_at=100.0)])  # 0.5 s
    assert probe.stalled([Marks(progress=5, progress_at=98.5, slowest=0.1, beats=9, alive_at=100.0)])
    # An honest 30 s step: the bound follows the slowest interval seen (3 x 30 s).
    assert not probe.stalled([Marks(progress=5, progress_at=40.0, slowest=30.0, beats=9, alive_at=100.0)])
    # Before its first interval a worker gets longer (start-up, warm-up): 10 s.
    assert not probe.stalled([Marks(progress=1, progress_at=92.0, slowest=0.0, beats=9, alive_at=100.0)])
    assert probe.stalled([Marks(progress=1, progress_at=89.0, slowest=0.0, beats=9, alive_at=100.0)])
    # One stalled worker of several is enough.
    assert probe.stalled([Marks(progress=5, progress_at=99.9, slowest=0.1, beats=9, alive_at=100.0),
                          Marks(progress=5, progress_at=98.5, slowest=0.1, beats=9, alive_at=100.0)])


def test_outside_the_training_function_or_before_the_heartbeat_nothing_is_a_stall():
    probe = _probe()
    assert not probe.stalled([Marks(progress=0, progress_at=1.0, beats=9), Marks(progress=3, progress_at=1.0, beats=0)])
    assert not probe.stalled([])


class _Session:
    lease_id = 7
    alive = True

    class lost:
        @staticmethod
        def is_set():
            return False


class _Etcd:
    """The two calls the probe makes: a member record, a report on our lease."""

    def __init__(self, members):
        self.members = members
        self.puts = []

    def get(self, key, **_):
        from elastic.rendezvous import KeyValue
        name = key.rsplit("/", 1)[1]
        if name not in self.members:
            return None
        addr, port = self.members[name]
        body = Member(name, name, addr, port, (), 0.0).to_json()
        return KeyValue(key, body, 0, 0, 0, 0)

    def put(self, key, value, lease=None):
        assert lease == 7
        self.puts.append((key.rsplit("/", 1)[1], json.loads(value)))


def _participant_in_round_4(*members):
    """The participant "me" of a round 4 whose ring is ``members``, one worker each."""
    from elastic.rendezvous import JobKeys
    from elastic.rendezvous.rounds import RoundPlan, Slot

    class Participant:
        keys = JobKeys("j")
        session = _Session()
        member = Member("me", "me", "10.0.0.1", 1, (), 0.0)

        class control:
            plan = RoundPlan(4, tuple(Slot(m, f"{m}.w0") for m in members),
                             {m: (m, "10.0.0.1") for m in members}, "10.0.0.1:1", 0.0)

    return Participant


def _recorded_events():
    """(the list of (name, fields) emitted, an event log that appends to it)."""
    emitted = []
    return emitted, type("Events", (), {"emit": lambda self, name, **kw: emitted.append((name, kw))})()


def test_with_three_passes_a_peer_is_reported_after_three_silent_ones_and_cleared_when_it_answers():
    Participant = _participant_in_round_4("me", "a", "b")
    etcd = _Etcd({"a": ("10.0.0.2", 2), "b": ("10.0.0.3", 3)})
    emitted, events = _recorded_events()
    silent = {"b"}
    answers = lambda addresses, timeout, resend_every, took: {m: SILENT if m in silent else REFUSED  # noqa: E731
                                                              for m in addresses}
    probe = PeerProbe(etcd, Participant(), events, probe=answers, passes=3)

    probe._probe_once()  # b silent once: nothing said yet, asked again at once
    assert etcd.puts == [] and probe._unconfirmed()
    silent.clear()
    probe._probe_once()  # it answers (its first SYN was lost): the count starts again
    clean = ("me", {"round": 4, "unreachable": []})
    assert etcd.puts == [clean] and not probe._unconfirmed()  # everyone answered in round 4
    silent.add("b")
    probe._probe_once()
    probe._probe_once()  # silent twice in a row: not yet
    assert etcd.puts == [clean] and probe._unconfirmed()
    probe._probe_once()  # three times in a row: reported
    assert etcd.puts == [clean, ("me", {"round": 4, "unreachable": ["b"]})]
    assert emitted[-1][0] == "peers_unreachable"
    probe._probe_once()  # nothing new: no write
    assert len(etcd.puts) == 2
    silent.clear()
    probe._probe_once()  # b answers again: the report is cleared
    assert etcd.puts[-1] == ("me", {"round": 4, "unreachable": []})
    assert emitted[-1] == ("peers_reachable", {"round": 4, "unreachable": [], "back": ["b"]})


def test_a_peer_that_answers_only_a_later_connect_is_said_slow_once_a_round_and_stays_reachable():
    Participant = _participant_in_round_4("me", "a")
    etcd = _Etcd({"a": ("10.0.0.2", 2)})
    emitted, events = _recorded_events()

    def answers(addresses, timeout, resend_every, took):
        took.update({m: 0.42 for m in addresses})  # heard on the second connect
        return {m: REFUSED for m in addresses}

    probe = PeerProbe(etcd, Participant(), events, probe=answers)
    probe._probe_once()
    probe._probe_once()
    assert emitted == [("peers_slow", {"round": 4, "answered_after_s": {"a": 0.42}})]
    assert etcd.puts == [("me", {"round": 4, "unreachable": []})]  # reachable: nothing decided on slowness
