"""The agent's peer probe: what counts as an answer, and when the ring looks stalled."""

import socket
import time

from elastic.agent.peer_probe import PeerProbe, unreachable
from elastic.progress import Marks


def test_an_accept_or_a_refusal_is_an_answer_silence_is_not():
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
            time.sleep(0.2)
            started = time.monotonic()
            silent = unreachable({
                "up": listening.getsockname(), "refusing": ("127.0.0.1", closed_port), "silent": full.getsockname(),
            }, timeout=0.5)
            took = time.monotonic() - started
        finally:
            for filler in fillers:
                filler.close()
            full.close()
    assert silent == {"silent"}
    assert took < 3.0  # all probed at once, each bounded by the timeout


class _FakeParticipant:
    keys = None
    session = None
    control = None

    class member:
        member_id = "m"


def _probe():
    return PeerProbe(None, _FakeParticipant(), None, floor=1.0, factor=3.0, clock=lambda: 100.0)


def test_a_worker_without_a_commit_for_the_bound_marks_the_ring_stalled():
    probe = _probe()
    probe.tick([Marks(progress=5, progress_at=99.5, slowest=0.1, beats=9, alive_at=100.0)])
    assert not probe._stalled.is_set()  # 0.5 s: within the 1 s floor
    probe.tick([Marks(progress=5, progress_at=98.5, slowest=0.1, beats=9, alive_at=100.0)])
    assert probe._stalled.is_set()
    # An honest 30 s step: the bound follows the slowest interval seen (3 x 30 s).
    probe.tick([Marks(progress=5, progress_at=40.0, slowest=30.0, beats=9, alive_at=100.0)])
    assert not probe._stalled.is_set()
    # Before its first interval a worker gets longer (start-up, warm-up): 10 s.
    probe.tick([Marks(progress=1, progress_at=92.0, slowest=0.0, beats=9, alive_at=100.0)])
    assert not probe._stalled.is_set()
    probe.tick([Marks(progress=1, progress_at=89.0, slowest=0.0, beats=9, alive_at=100.0)])
    assert probe._stalled.is_set()


def test_outside_the_training_function_or_before_the_heartbeat_nothing_is_a_stall():
    probe = _probe()
    probe.tick([Marks(progress=0, progress_at=1.0, beats=9), Marks(progress=3, progress_at=1.0, beats=0)])
    assert not probe._stalled.is_set()
    probe.tick([])
    assert not probe._stalled.is_set()
