"""The worker's session: what lives as long as the training process, across all its rings.

``elastic.init()`` starts one (``lifecycle.py``): the worker's config, its etcd client and
the job's control channel, the events log, the step log and the monitors that watch
every ring (the hang watchdog's progress marks, the straggler watch, the left-behind
check), closed together in one ``ExitStack``. It has no rank, no world and no round: those
are a ring's (``ring.py``), and the way from one ring to the next is its ``entry``
(``ring_entry.py``; a world of one: ``local_ring.py``). Where this worker stands before
its first ring (a joiner's rank, ``hvd.rank()`` before the first sync) is the entry's
``position``.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Optional

import torch

from elastic.rendezvous import ControlChannel, Etcd, EtcdConfig, JobKeys
from elastic.rendezvous.job_secret import read_private_file
from elastic.rendezvous.member_sync import follow_members

from ..contract.agent_channel import tell_agent
from ..contract.devices import capability
from ..contract.events import EventLog
from ..contract.progress import Progress
from ..contract.worker_config import WorkerConfig
from .commit_gate import Monitors
from .left_behind import LeftBehindCheck
from .local_ring import LOCAL_CONFIG, LocalRing
from .ring_entry import RingEntry
from .ring_view import ALONE, Position, RingView
from .step_log import StepLog
from .stragglers import StragglerWatch


class LocalEntry:
    """The way into the world of one: one ring, there from the start (or a test's ring)."""

    joining_round = None

    def __init__(self, ring: RingView):
        self.ring = ring
        self.position: Position = ALONE

    @property
    def round(self) -> int:
        return self.ring.round

    @property
    def formed(self) -> RingView:
        return self.ring

    def leave_held(self) -> None:
        self.ring.leave(failed=False)


class WorkerSession:
    """See the module docstring. Built by ``join`` (under elastic-run) or ``alone``."""

    def __init__(self, config: WorkerConfig, events: EventLog, steps: StepLog, monitors: Monitors,
                 entry, stack: Optional[ExitStack] = None):
        self.config = config
        self.events = events
        self.steps = steps
        self.monitors = monitors
        self.entry = entry  # RingEntry, or LocalEntry
        self._stack = stack or ExitStack()

    # -- the ways to start one -----------------------------------------------------------
    @classmethod
    def alone(cls) -> "WorkerSession":
        """Not under elastic-run: a world of one, so scripts stay runnable alone."""
        events = EventLog(None, host="local")
        steps = StepLog(events, "local")
        LocalRing.form()
        return cls(LOCAL_CONFIG, events, steps, Monitors(steps), LocalEntry(LocalRing(events, steps)))

    @classmethod
    def serving(cls, ring: RingView) -> "WorkerSession":
        """A session whose one ring is ``ring``, built elsewhere (a test's ``FakeRing``, a
        benchmark's); nothing is started."""
        steps = StepLog(ring.events, ring.config.worker_id)
        return cls(ring.config, ring.events, steps, Monitors(steps), LocalEntry(ring))

    @classmethod
    def join(cls, config: WorkerConfig) -> "WorkerSession":
        """Follow the job ``config`` names: etcd, its control channel, the monitors; this
        worker's first plan, and the job's first round entered (a joiner's at its first sync)."""
        events = EventLog(config.events_file, host=config.host_id)
        steps = StepLog(events, config.worker_id)  # for the timeline
        with ExitStack() as stack:  # whatever opened is closed again if the start fails
            progress = None
            if config.progress_file:
                progress = Progress(config.progress_file, config.stacks_file)
                stack.callback(progress.close)
            stragglers = StragglerWatch(events, config.worker_id, config.straggler_ratio,
                                         tell_agent=lambda message: tell_agent(config, message))
            stack.callback(stragglers.close)
            if config.marker_file:
                # Tells the agent this worker follows rounds itself (no restart on change).
                with open(config.marker_file, "w") as f:
                    f.write(str(os.getpid()))
            etcd = follow_members(Etcd(_etcd_config(config)))  # a served etcd's members move (rendezvous/served.py)
            stack.callback(etcd.close)
            control = ControlChannel(etcd, JobKeys(config.job_id)).start()
            stack.callback(control.close)
            left_behind = LeftBehindCheck(etcd, JobKeys(config.job_id), config.worker_id, config.rdzv_ttl)
            stack.callback(left_behind.close)
            monitors = Monitors(steps, control, left_behind, progress, stragglers)
            stack.callback(monitors.close)
            # The device slot its agent gave this process (device_slots.py): LOCAL_RANK and the
            # CUDA device for its whole life, set once, before any process group exists.
            local_rank = config.device_slot if config.device_slot is not None else 0
            backend = capability(config.backend)
            if backend.nccl:
                torch.cuda.set_device(local_rank)
            entry = RingEntry(config, control, etcd, events, monitors, backend, local_rank)
            control.add_listener(entry.cell.on_control)
            session = cls(config, events, steps, monitors, entry, stack.pop_all())
        try:
            entry.start()
        except BaseException:
            session.shutdown()
            raise
        return session

    # -- what the API asks of it ---------------------------------------------------------
    @property
    def position(self) -> Position:
        """Where this worker stands: its ring's rank and world, a joiner's before its ring."""
        return self.entry.position

    @property
    def round(self) -> int:
        """The round of this worker's ring (0 before its first)."""
        return self.entry.round

    @property
    def ring(self) -> RingView:
        """The ring this worker trains on (``State.commit()`` asks it)."""
        return self.entry.ring

    @property
    def joining_round(self) -> Optional[int]:
        """The round a joiner enters at its first sync; None once it is in a ring."""
        return self.entry.joining_round

    # -- its end -------------------------------------------------------------------------
    def end_training(self) -> None:
        """The training function returned for good: no more steps for the watchdog to judge."""
        self.steps.close()
        board = self.monitors.board
        if board is not None:
            board.left_training()

    def shutdown(self) -> None:
        self.steps.close()
        self.entry.leave_held()
        self._stack.close()


def _etcd_config(config: WorkerConfig) -> EtcdConfig:
    return EtcdConfig.from_string(
        config.endpoints,
        ca_cert=config.etcd_ca,
        cert_cert=config.etcd_cert,
        cert_key=config.etcd_key,
        user=config.etcd_user,
        password=read_private_file(config.etcd_password_file, "etcd password file")
        if config.etcd_password_file else None,
        retry_deadline=config.etcd_retry_deadline,
        member_sync=config.etcd_member_sync,
    )
