"""Spares of a hybrid mesh: workers of a broken replica group that wait, in the ring, without training.

A spare stays in the round's ring (its agent still offers it, and a replacement will
complete its group), so it must take part in what the ring does at every commit: the
ring's commit gate runs a pace exchange (an all_gather over the whole ring) every few
commits and decides switches (a join, a leave, a stop) at commits counted alike on
every rank. A spare has no commits of its own: the training ranks' lead (the lowest
training rank) sends each spare one tick per commit, the spare runs the gate with it
(``Ring.commit`` with nothing to capture) and answers once its gate is through. The
lead waits for that answer after its own gate: when rank 0 (which decides switches) is
a spare, no training rank passes its next commit before rank 0 has decided on this one,
the order ``switch_points.py`` relies on. Cost per commit while a spare waits: a 16-byte
message out and an 8-byte one back per spare, and the spare's round trip on the lead.

When the training function returns, the lead sends an end tick: the spare leaves its
wait as finished (``TrainingFinished``). A switch, a stop or a broken ring reach it as
they reach every worker: from its own gate or from the tick that fails.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.distributed as dist

from ..worker.commit_gate import act_on
from ..worker.outcome import TrainingFinished

log = logging.getLogger(__name__)

_TICK_TAG = (1 << 27) + 7  # apart from the re-shard's tags (per pair, from 0) and the replicas' (1 << 28)
_ACK_TAG = _TICK_TAG + 1
COMMIT, END = 1, 2


def wait_as_spare(ring, lead: int) -> None:
    """Run the commit gate at every commit of the training ranks until the ring changes
    (raises what the gate's verdict says) or training ends (``TrainingFinished``)."""
    ring.begin()  # the gate's commits count from this round's first, as the trainers' do
    tick = torch.zeros(2, dtype=torch.int64)
    answer = torch.ones(1, dtype=torch.int64)
    while True:
        dist.recv(tick, src=lead, tag=_TICK_TAG)
        kind, count = int(tick[0]), int(tick[1])
        if kind == END:
            log.info("round %d: training finished while this worker was a spare", ring.round)
            raise TrainingFinished()
        verdict = ring.commit(lambda _ring: count)
        dist.send(answer, dst=lead, tag=_ACK_TAG)
        act_on(verdict, count)


class SpareTicks:
    """The lead's side: a tick to every spare per commit, their answers after the gate."""

    def __init__(self, spares: Sequence[int]):
        self.spares = tuple(spares)
        self._sent: list = []
        self._tick = torch.zeros(2, dtype=torch.int64)
        self._answer = torch.zeros(1, dtype=torch.int64)

    def post(self, count: int) -> None:
        """At a commit, before the gate's exchange (which the spares join on this tick)."""
        self._tick[0], self._tick[1] = COMMIT, count
        self._sent = [dist.isend(self._tick, dst=spare, tag=_TICK_TAG) for spare in self.spares]

    def answered(self) -> None:
        """After the gate: every spare's gate is through this commit too."""
        for spare in self.spares:
            dist.recv(self._answer, src=spare, tag=_ACK_TAG)
        for work in self._sent:
            work.wait()
        self._sent = []

    def end(self, count: int) -> None:
        """Training returned: the spares finish."""
        end = torch.tensor([END, count], dtype=torch.int64)
        for spare in self.spares:
            dist.send(end, dst=spare, tag=_TICK_TAG)
