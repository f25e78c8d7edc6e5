"""Is that agent alive? The one probe, what each answer proves, and the one revocation (liveness.py)."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from elastic.rendezvous.keys import JobKeys
from elastic.rendezvous.liveness import (ACCEPTED, REFUSED, SILENT, Answer, answer_of, evict_dead_members, probe,
                                         proves_dead, reachable, read_member)
from elastic.rendezvous.rounds import Member
from tests.fakes.kv import MemoryKv

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("answer, dead, reached", [
    (ACCEPTED, False, True),  # the agent listens
    (REFUSED, True, True),  # the host answered, the agent is gone: proof of death, and reachable
    (SILENT, False, False),  # no proof either way; unreachable from here
])
def test_what_each_answer_proves(answer, dead, reached):
    assert (proves_dead(answer), reachable(answer)) == (dead, reached)
    assert {proves_dead(a) for a in Answer} == {True, False}  # every answer is decided, one way or the other


def test_one_probe_asks_many_agents_at_once():
    with socket.create_server(("127.0.0.1", 0)) as listening:
        with socket.create_server(("127.0.0.1", 0)) as closed:
            closed_port = closed.getsockname()[1]
        # A listener whose accept queue is full drops further SYNs: no answer at all,
        # what a peer behind a partition looks like (no RST, no ICMP).
        full = socket.socket()
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        fillers = []
        try:
            for _ in range(8):  # the kernel's queue is a little longer than the backlog
                filler = socket.socket()
                filler.setblocking(False)
                filler.connect_ex(full.getsockname())
                fillers.append(filler)
            # Wait for the handshakes the queue takes (their sockets turn writable); the
            # ones beyond it stay pending, and so will the probe's.
            assert select.select([], fillers, [], 5.0)[1], "no connection reached the listener"
            started = time.monotonic()
            answers = probe({"up": listening.getsockname(), "refusing": ("127.0.0.1", closed_port),
                             "silent": full.getsockname(), "nameless": ("no-such-host.invalid", 9)}, timeout=0.5)
            took = time.monotonic() - started
            assert answer_of(*listening.getsockname()) is ACCEPTED
        finally:
            for filler in fillers:
                filler.close()
            full.close()
    assert answers == {"up": ACCEPTED, "refusing": REFUSED, "silent": SILENT, "nameless": SILENT}
    assert took < 3.0  # all probed at once, each bounded by the timeout
    assert probe({}, timeout=0.1) == {}


def test_a_prober_late_past_its_deadline_takes_the_answers_the_kernel_already_has():
    """A starved prober (no CPU, or the GIL elsewhere) may wake after its deadline: the
    answers that arrived meanwhile count, they are not taken for silence. (Timeout 0:
    the prober looks only once, after its connect went out.)"""
    with socket.create_server(("127.0.0.1", 0)) as listening:
        answers = [probe({"up": listening.getsockname()}, timeout=0.0)["up"] for _ in range(20)]
    # Loopback answers within microseconds; the one look at the deadline sees nearly all.
    assert answers.count(ACCEPTED) >= 15, answers


def _full_listener():
    """A listener whose accept queue is full: it drops SYNs (no answer at all) until
    ``drain`` accepts what is queued."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(full.getsockname())
        fillers.append(filler)
    assert select.select([], fillers, [], 5.0)[1], "no connection reached the listener"

    def drain():
        full.setblocking(False)
        accepted = []
        while True:
            try:
                accepted.append(full.accept()[0])
            except BlockingIOError:
                return accepted

    return full, fillers, drain


@pytest.mark.parametrize("resend_every, expected", [(0.25, ACCEPTED), (None, SILENT)])
def test_a_fresh_connect_every_so_often_is_answered_once_a_drop_is_over(resend_every, expected):
    """SYNs dropped for the first 0.2 s (a full queue here; a blip or a lost packet on a
    real link): a connect sent after that is answered, so a prober that sends another
    every 0.25 s hears the peer within 0.75 s; one connect alone waits for the kernel's
    own retransmission (1 s) and hears nothing in time."""
    full, fillers, drain = _full_listener()
    opened = []
    timer = threading.Timer(0.2, lambda: opened.extend(drain()))  # the drop's length, not a synchronisation
    try:
        timer.start()
        answer = probe({"peer": full.getsockname()}, timeout=0.75, resend_every=resend_every)["peer"]
    finally:
        timer.cancel()
        timer.join()
        for sock in fillers + opened:
            sock.close()
        full.close()
    assert answer is expected


def _register(kv: MemoryKv, keys: JobKeys, member_id: str, port: int) -> int:
    lease = kv.grant_lease(30.0)
    member = Member(member_id=member_id, host=member_id, addr="127.0.0.1", store_port=port, workers=(f"{member_id}0",),
                    joined=0.0)
    kv.put(keys.member(member_id), member.to_json(), lease=lease)
    return lease


def test_only_the_members_proven_dead_are_evicted():
    kv, keys = MemoryKv(), JobKeys("j")
    with socket.create_server(("127.0.0.1", 0)) as alive:
        with socket.create_server(("127.0.0.1", 0)) as gone:
            closed = gone.getsockname()[1]
        _register(kv, keys, "a", alive.getsockname()[1])
        _register(kv, keys, "b", closed)
        kv.put(keys.member("c"), b"not a member")  # unreadable: no address to prove anything with
        assert evict_dead_members(kv, keys, ["a", "b", "c", "d", "b"]) == ["b"]
    assert read_member(kv, keys, "b") is None and read_member(kv, keys, "a")[0].member_id == "a"
    assert read_member(kv, keys, "c") is None
