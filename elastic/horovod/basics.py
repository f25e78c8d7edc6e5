"""Horovod's process queries on this runtime: init, rank, size, local and cross ranks.

``hvd.init()`` joins the job through ``elastic.init()``; the ranks come from the
worker's current position in its round, so they follow the ring after every re-formation
(Horovod's own ``hvd.rank()`` does the same after an elastic reset).
"""

from __future__ import annotations

import os
import socket
from ..contract.errors import ElasticError
from ..worker import exit_record, lifecycle

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."

# Whether hvd.init() was called and hvd.shutdown() has not been since. The runtime
# itself stays joined until the process exits (leaving the ring is a membership
# change, not a call a script makes between two tests), so init() after shutdown()
# returns the same rank and size, as Horovod's gloo build does.
_initialized = False
_environment_set = False
_plain = False  # a collective ran outside @elastic.run: the agent restarts every worker on a failure


def init(comm=None, process_sets=None) -> None:
    """Join the job (idempotent). ``comm`` and ``process_sets`` other than the whole
    world are not supported: every collective runs on the whole ring."""
    global _initialized
    if comm is not None and not _is_whole_world(comm):
        raise NotImplementedError("hvd.init(comm=...): only the whole world is supported under elastic-run")
    if process_sets not in (None, [], ()):
        raise NotImplementedError("hvd.init(process_sets=...): process sets are not supported under elastic-run")
    lifecycle.start()
    found = session()
    if found.config.restarted_all and found.joining_round is not None:
        # Every worker was restarted for this round (a script without hvd.elastic.run, its
        # agent restarting them all, as torchrun): nobody runs a ring to join, so the round
        # is entered now, as the job's first one, for broadcast_parameters to run on it.
        found.entry.enter(found.entry.joining_plan(), previous_plan=None)
    _initialized = True
    _set_launcher_environment()


def follows_rounds(yes: bool) -> None:
    """Tell this worker's agent whether it re-forms its ring in-process (the runtime's marker
    file, written by ``elastic.init()``). A Horovod script that runs collectives outside a
    run function (``hvd.init``, ``DistributedOptimizer``, ``broadcast_parameters``, no
    ``hvd.elastic.run``: Horovod's own examples) cannot follow a new ring there: its agent
    treats it as torchrun treats any script, restarting every worker on a failure.
    ``hvd.elastic.run`` says yes again."""
    global _plain
    try:
        config = session().config
    except ElasticError:
        return  # hvd.init() not called: run() says so itself
    marker = config.marker_file
    _plain = not yes
    if not marker:
        return  # not under elastic-run
    if yes:
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
    else:
        try:
            os.unlink(marker)
        except FileNotFoundError:
            pass


def collective_outside_run() -> None:
    """A collective is about to run: outside ``@elastic.run``, this is a non-elastic script."""
    if not _plain and not exit_record.trains_under_run():
        follows_rounds(False)


def _is_whole_world(comm) -> bool:
    return isinstance(comm, (list, tuple)) and len(comm) == 0


def shutdown() -> None:
    """Mark Horovod as shut down; ``init()`` afterwards gives the same rank and size."""
    global _initialized
    _initialized = False


def is_initialized() -> bool:
    return _initialized


def require_initialized() -> None:
    if not _initialized:
        raise ValueError(NOT_INITIALIZED)


def _position():
    """Where this worker stands (``worker/ring_view.py``): a joiner's rank and its round's
    plan are known before its ring forms at its first sync (``hvd.rank()`` before it)."""
    require_initialized()
    return session().position


def session():
    """This process's ``WorkerSession``, once ``elastic.init()`` (or ``hvd.init()``) ran:
    the Horovod layer's one way to it. ElasticError before."""
    return lifecycle.current()


def rank() -> int:
    return _position().rank


def size() -> int:
    return _position().world_size


def local_rank() -> int:
    return _position().local_rank


def local_size() -> int:
    return _position().local_world_size


def cross_rank() -> int:
    """The index of this worker's host among the hosts of the ring."""
    position = _position()
    plan = position.plan
    if plan is None:  # a world of one
        return 0
    return plan.member_order().index(plan.slots[position.rank].member_id)


def cross_size() -> int:
    """How many hosts run a worker with this worker's local rank."""
    position = _position()
    plan = position.plan
    if plan is None:
        return 1
    return sum(1 for member in plan.member_order() if len(plan.local_ranks(member)) > position.local_rank)


def is_homogeneous() -> bool:
    """Does every host run the same number of workers?"""
    plan = _position().plan
    if plan is None:
        return True
    return len({len(plan.local_ranks(member)) for member in plan.member_order()}) == 1


def hostname() -> str:
    position = _position()
    plan = position.plan
    if plan is not None:
        member = plan.slots[position.rank].member_id
        if member in plan.hosts:
            return str(plan.hosts[member][0])
    return socket.gethostname()


def _set_launcher_environment() -> None:
    """Set the variables horovodrun gives each worker, once, at the first init.

    As under Horovod's elastic launcher they describe the start assignment and
    are not updated after a re-formation; a variable already set is kept."""
    global _environment_set
    if _environment_set:
        return
    _environment_set = True
    values = {
        "HOROVOD_RANK": rank(), "HOROVOD_SIZE": size(),
        "HOROVOD_LOCAL_RANK": local_rank(), "HOROVOD_LOCAL_SIZE": local_size(),
        "HOROVOD_CROSS_RANK": cross_rank(), "HOROVOD_CROSS_SIZE": cross_size(),
        "HOROVOD_HOSTNAME": hostname(),
    }
    for name, value in values.items():
        os.environ.setdefault(name, str(value))

