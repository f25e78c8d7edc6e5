"""The job's timeouts, together: which combinations elastic-run refuses and which it warns about.

Each timeout bounds one wait, but a recovery runs through several of them in turn: a host
that goes silent leaves the members after ``--rdzv-ttl``; until then its peers wait in
their collectives (``--collective-timeout``), a worker waits for its round at most
``--rdzv-timeout``, a round forms once the members have been still for ``--rdzv-settle``,
and the agent's watchdog kills a worker that made no progress for ``--hang-timeout``.
A worker that was paused reads etcd at its next commit once the pause was longer than
the pause threshold, a quarter of the TTL: no plan can leave it behind in less than the
TTL, so that order holds by construction.

One ``Timeouts`` is built from elastic-run's options (``AgentConfig.timeouts``), reviewed
at launch, used by the agent, and reaches every worker: ``WorkerConfig`` carries its
values through the worker's environment and gives the same object back
(``WorkerConfig.timeouts``). The defaults are written here once.

The waits that follow from the user's timeouts are derived here too, not kept as
constants beside the code that waits: a survivor's agent looks for a dead coordinator for
``succession_patience`` (two TTLs: by then the coordinator's lease has decided). The
fixed intervals that do not follow from them stay where they are, each saying why: the
agent's ``_STARTUP_S`` (a script's start, importing torch, is not one of the job's
waits), ``nccl_abort.ABORT_DEADLINE_S`` (the driver's abort, not the network's),
``succession.CHECK_EVERY_S`` (etcd's re-election, about a second, sets it).

No strict order is imposed: the tests, and users, have good reasons for a short
rendezvous timeout (fail fast when the workers do not come) or a short collective
timeout. ``review`` is a pure function, tested as a table (tests/unit/contract/test_timeouts.py):
an ``ERROR`` is a combination that cannot work, refused with one line before anything
starts; a ``WARNING`` is one that works until a particular failure, then costs it more
than the user probably meant, and is said once, like the options that have no effect
(``elastic/cli/no_effect.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ERROR, WARNING = "error", "warning"

# The pause clock's threshold, as a share of the TTL (worker/left_behind.py): a plan can
# leave a worker behind no sooner than the TTL after it went silent.
PAUSE_SHARE = 0.25


def pause_threshold(ttl: float) -> float:
    """Seconds of pause after which a worker checks etcd before it commits again."""
    return ttl * PAUSE_SHARE


# A survivor's agent looks for a dead coordinator this many TTLs after its ring broke
# (rendezvous/succession.py): by then a dead coordinator's lease has expired anyway.
PATIENCE_TTLS = 2.0


@dataclass(frozen=True)
class Timeouts:
    """The job's timeouts in seconds, built once from elastic-run's options."""

    ttl: float = 10.0  # --rdzv-ttl: a silent host is declared lost after this
    collective: float = 60.0  # --collective-timeout: a collective blocked this long has failed
    rendezvous: float = 600.0  # --rdzv-timeout: a worker waits this long for its round (and the job below --min-np)
    settle: float = 0.5  # --rdzv-settle: the members' stillness a round waits for
    hang: Optional[float] = None  # --hang-timeout: None derives it, 0 turns detection off
    nccl: bool = False  # the job's workers use NCCL (the watchdog then judges device work too)

    @property
    def pause(self) -> float:
        return pause_threshold(self.ttl)

    @property
    def succession_patience(self) -> float:
        """How long a survivor's agent looks for a dead coordinator after its ring broke."""
        return PATIENCE_TTLS * self.ttl

    @property
    def fixed_hang(self) -> Optional[float]:
        """The hang timeout the user fixed, or None (derived, or detection off)."""
        return self.hang if self.hang else None


def review(t: Timeouts) -> list[tuple[str, str]]:
    """(ERROR or WARNING, one line) for each combination of ``t`` that cannot work or is
    suspicious; empty when all is well."""
    found = []
    if t.settle >= t.rendezvous:
        # A round forms only once the members have been still for the settle window (the
        # first round, and every round that admits joiners), and a worker gives up on the
        # round that includes it after the rendezvous timeout: it gives up first.
        found.append((ERROR, f"--rdzv-settle {t.settle:g} is not below --rdzv-timeout {t.rendezvous:g}: a worker "
                             "would give up on its round before the round could form"))
    if t.collective < t.ttl:
        # Works: the peers' collectives fail, the round they ask for may still name the
        # silent host until its lease expires, and they wait for the next one. It spends a
        # re-formation of --max-resets and the time of the TTL anyway.
        found.append((WARNING, f"--collective-timeout {t.collective:g} is below --rdzv-ttl {t.ttl:g}: when a host "
                               "goes silent its peers give up on their ring before it is declared lost, "
                               "and spend a re-formation waiting for it"))
    if t.rendezvous < t.ttl:
        # Works when every host stays (a short rendezvous timeout fails fast when workers
        # do not come); after a silent loss a worker may give up before the host's lease
        # expires and a round without it can come.
        found.append((WARNING, f"--rdzv-timeout {t.rendezvous:g} is below --rdzv-ttl {t.ttl:g}: after a host goes "
                               "silent a worker may give up waiting for a round before the host is declared lost"))
    hang = t.fixed_hang
    if t.nccl and hang is not None and hang < t.collective:
        # The derived bound waits past the collective timeout on NCCL (agent/watchdog.py
        # device_floor): a rank waiting in a collective for a slow but healthy peer (rank 0
        # saving or evaluating alone) has device work pending as long as the peer is away.
        found.append((WARNING, f"--hang-timeout {hang:g} is below --collective-timeout {t.collective:g} on NCCL: "
                               "a rank waiting for a slow peer is killed as hung before its ring times out"))
    if t.nccl and hang is not None and hang < t.ttl:
        # The same wait at a silent host's loss lasts until the TTL declares it lost: every
        # one of its peers would be killed as hung first, and the ring could not re-form.
        found.append((WARNING, f"--hang-timeout {hang:g} is below --rdzv-ttl {t.ttl:g} on NCCL: when a host goes "
                               "silent its peers are killed as hung before it is declared lost"))
    return found
