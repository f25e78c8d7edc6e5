"""Shrinking the NCCL communicator after a loss, instead of building a new one.

When a round only loses workers (nobody joins, the survivors keep their order), its
survivors can keep their NCCL communicator less the lost ranks (``ncclCommShrink``,
NCCL >= 2.27, which torch >= 2.13 exposes as the NCCL backend's ``shrink``): no new
bootstrap through the store, no new topology search, no new buffers. Everything else
about the round is as usual: a fresh gloo part on the round's store, the same abort
handle, the same checks. ``ranks_to_exclude`` decides when (a pure function, tested as
a table); on with ``ELASTIC_NCCL_SHRINK=1`` (docs/gpus.md). Off by default until it has run
on a GPU: NCCL's shrink, and the stall of a round whose workers do not all hold a shrunk
communicator (up to TORCH_NCCL_NONBLOCKING_TIMEOUT), are measured there, not here.

Where the shrink happens, and why there. Not in ``RingEntry.form``: by then the old
communicator is gone. The survivors abort their ring as soon as the plan that names the
loss arrives (``RingCell.on_control``), and the recovery path aborts it again before the
device check (``Ring.abort_device``) and at the leave (``leave_ring``): its kernels wait
for the dead peer, and only an abort ends them, which the device check must see done.
So the shrink takes the place of the plan's abort of the default group's communicator
(``shrink_then_abort``), on the abort's own thread and under its deadline: with
``SHRINK_ABORT`` NCCL first ends the parent's pending kernels (it raises the
communicator's abort flag and waits for its stream), then forms the child among the
survivors; the child's bootstrap reaches the peers through fresh connections to their
listening sockets, so the connections the abort shut first (gloo's, the store's, NCCL's
old ones) are not missed. The parent is then aborted as before, so check_ring, the
device check and ``leave_ring`` see the ring exactly as after any abort. The child is
kept, registered nowhere, in a ``ShrunkForNextRound``, until that round forms.

Why every worker must agree first. The shrink is collective over the survivors, and only
those whose ring the plan aborted have one: a worker whose ring was aborted earlier (its
device watch saw NCCL's error, or its own collective failed first) has no communicator
left to shrink, and the others' shrink waits for it until torch gives up (the
non-blocking communicators' timeout, which ``Support.bounded`` requires to be within the
abort's deadline). So ``init_group`` builds the round on shrunk communicators only when
every worker of the round says in the round's store that it holds one that fits;
otherwise all of them build a new group as always.

Why not torch's ``shrink_group``. It shrinks the default group by destroying it
(``destroy_process_group`` finalizes communicators, which waits for the peers: this
runtime never does that after a loss, ring_abort.leave_ring), destroys every other
group the same way, registers a default group with the NCCL part alone (the gloo part,
which carries the runtime's object collectives and small exchanges, is gone), and changes
torch's registry from the calling thread, here the control thread, under the main
thread's feet. It calls the backend's ``shrink`` itself (its step 5); so does this module.

torch's private API, used here only: ``ProcessGroup._register_backend`` and
``_set_default_backend`` put the shrunk communicator into a group made by
``init_process_group("cpu:gloo")`` (there is no public way to give a group an existing
backend), and ``distributed_c10d._world`` records the group's backend string
(``cpu:gloo,cuda:nccl``, which ``dist.get_backend``, ``prepare_ring`` and ``new_group``'s
defaults read) and lists the other groups to abort, as ``nccl_abort`` does.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from elastic.rendezvous import RoundPlan

from ..contract import round_keys
from ..contract.console import FILE_ONLY
from ..contract.devices import Capability, capability as capability_of
from . import nccl_abort

log = logging.getLogger(__name__)

ENV = "ELASTIC_NCCL_SHRINK"  # "1": shrink where allowed; else always build a new communicator
MIN_NCCL = (2, 27, 0)  # ncclCommShrink
SHRINK_ABORT = 0x01  # NCCL_SHRINK_ABORT (torch's distributed_c10d.SHRINK_ABORT): end the parent's kernels first


@dataclass(frozen=True)
class Support:
    """What this process's torch and NCCL allow, and what the user chose."""

    torch_shrinks: bool  # torch has shrink_group (hence the backend's shrink it calls)
    nccl_version: Optional[tuple]  # NCCL's runtime version, (major, minor, patch); None without NCCL
    opted_out: bool  # ELASTIC_NCCL_SHRINK is not 1 (off by default)
    # A shrink that a peer never joins ends within the abort's deadline: non-blocking
    # communicators, whose wait torch ends at TORCH_NCCL_NONBLOCKING_TIMEOUT (the agent sets
    # it from the world size). A blocking one would wait for ever, and the deadline would
    # end the worker.
    bounded: bool = True


def ranks_to_exclude(previous: Optional[RoundPlan], new: RoundPlan, capability: Capability, support: Support, *,
                     communicator_held: bool) -> Optional[tuple]:
    """The ranks of ``previous``'s ring to leave out of its NCCL communicator for ``new``'s
    ring, or None: build a new one, as always.

    Only for the round right after ``previous`` whose workers are ``previous``'s less some
    it names lost, in the same order (the ranks close up as NCCL's shrink numbers them:
    a survivor's new rank is its old one less the excluded ranks below it); on the
    previous round's store (the shrunk communicator keeps it for what NCCL makes later);
    for a ``cpu:gloo,cuda:nccl`` group (the gloo part is made afresh beside the shrunk one:
    a pure NCCL group has no part ``init_process_group`` could make alone); with torch's
    shrink, NCCL >= 2.27, a bounded wait (``Support.bounded``) and the old communicator
    still intact (``communicator_held``: not aborted, no error reported); unless opted out.
    """
    if previous is None or support.opted_out or not communicator_held:
        return None
    if capability.host_backend != "gloo" or capability.device_backend != "nccl":
        return None
    if not support.torch_shrinks or not support.bounded:
        return None
    if support.nccl_version is None or tuple(support.nccl_version[:3]) < MIN_NCCL:
        return None
    if new.round != previous.round + 1 or new.store_addr != previous.store_addr:
        # A skipped round: a survivor that saw only the newer plan would exclude other ranks.
        return None
    old = previous.worker_ids()
    excluded = tuple(rank for rank, worker in enumerate(old) if worker not in set(new.worker_ids()))
    if not excluded or not {old[rank] for rank in excluded} <= set(new.lost):
        return None  # nobody left, or someone left gracefully (a planned switch, not a broken ring)
    survivors = tuple(worker for rank, worker in enumerate(old) if rank not in excluded)
    if new.worker_ids() != survivors:
        return None  # a newcomer, or survivors in another order
    return excluded


def support_here(environ: Optional[Mapping[str, str]] = None) -> Support:
    """This process's ``Support`` (call it only for a group with an NCCL part)."""
    environ = os.environ if environ is None else environ
    from torch.distributed import distributed_c10d

    return Support(torch_shrinks=hasattr(distributed_c10d, "shrink_group"), nccl_version=_nccl_version(),
                   opted_out=environ.get(ENV, "0").strip() != "1", bounded=_bounded(environ))


def _nccl_version() -> Optional[tuple]:
    try:
        if not dist.is_nccl_available():
            return None
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL: no version to read
        return None
    return tuple(version) if isinstance(version, tuple) else None


def _bounded(environ: Mapping[str, str]) -> bool:
    if environ.get("TORCH_NCCL_USE_COMM_NONBLOCKING", "").strip().lower() not in ("1", "true", "yes", "y"):
        return False
    try:
        timeout_s = int(environ.get("TORCH_NCCL_NONBLOCKING_TIMEOUT", ""))
    except ValueError:  # unset: torch waits 30 minutes
        return False
    # Twice: the abort that follows a failed shrink may wait that long again (for a
    # collective holding a forming communicator's lock: nccl_abort.py), both under one deadline.
    return 0 < 2 * timeout_s < nccl_abort.ABORT_DEADLINE_S


# -- at the abort: the shrink ------------------------------------------------------------
@dataclass(frozen=True)
class Groups:
    """The process groups an abort ends: the default one and every other."""

    default: object  # a ProcessGroup (or None: none left)
    others: Sequence[object]


def torch_groups() -> Groups:
    from torch.distributed import distributed_c10d

    default = distributed_c10d.GroupMember.WORLD
    names = distributed_c10d._world.pg_names  # private: every group of the process (as nccl_abort reads it)
    return Groups(default, [group for group in names if group is not default])


def shrink_then_abort(backend, excluded: Sequence[int], keep: Callable[[object], None],
                      groups: Optional[Groups] = None) -> None:
    """In place of ``nccl_abort.abort_every_group(backend)`` (``RingHandle.abort``'s
    ``backend_abort``): shrink ``backend``, the default group's NCCL part, without
    ``excluded`` (SHRINK_ABORT: its pending kernels end first) and hand the shrunk one to
    ``keep``; then abort the default group as always, every other group at the same time
    (each on a thread of its own: nccl_abort.abort_all_at_once says why). A shrink that
    fails is one log line: the abort that follows it is today's."""
    groups = torch_groups() if groups is None else groups

    def shrink_the_default_group() -> None:
        try:
            if not getattr(backend, "supports_shrinking", False):
                raise RuntimeError("this torch's NCCL backend cannot shrink (built with NCCL < 2.27)")
            keep(backend.shrink(list(excluded), SHRINK_ABORT))
        except Exception as exc:  # noqa: BLE001 - the abort below is the fallback
            log.warning("shrinking the NCCL communicator failed (%s: %s); it is aborted, the next round builds "
                        "a new one", type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                        extra=FILE_ONLY)
        finally:
            (groups.default if groups.default is not None else backend).abort()

    nccl_abort.abort_all_at_once([shrink_the_default_group, *(group.abort for group in groups.others)])


def drop(shrunk) -> None:
    """Abort a shrunk communicator no round will use (bounded: past the abort's deadline the
    worker exits as broken, as for any abort)."""
    if shrunk is None:
        return
    done = nccl_abort.run_with_deadline(shrunk.abort, nccl_abort.ABORT_DEADLINE_S, nccl_abort.exit_broken,
                                        "elastic-drop-shrunk")
    done.wait(nccl_abort.ABORT_DEADLINE_S)


class ShrunkForNextRound:
    """The communicator an abort shrank for the next round, until that round forms: the
    abort's thread puts it, the main thread takes it in ``RingEntry.form``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: Optional[tuple] = None  # (plan it was shrunk for, backend)

    def put(self, plan: RoundPlan, shrunk) -> None:
        with self._lock:
            replaced, self._held = self._held, (plan, shrunk)
        if replaced is not None:
            drop(replaced[1])

    def take(self, plan: RoundPlan):
        """The communicator shrunk for ``plan``'s round, or None; one shrunk for another
        round (superseded before it formed) is aborted."""
        with self._lock:
            held, self._held = self._held, None
        if held is None:
            return None
        made_for, shrunk = held
        if made_for.round == plan.round and made_for.slots == plan.slots:
            return shrunk
        drop(shrunk)
        return None


# -- at the round's form: the group ------------------------------------------------------------
def every_worker_holds_one(store, rank: int, world_size: int, holds: bool) -> bool:
    """Say in the round's store whether this worker holds a shrunk communicator that fits;
    True when every worker of the round does (each waits for all the answers: the store's
    timeout bounds a peer that never answers, and the round's abort shuts the store)."""
    store.set(f"{round_keys.SHRUNK}{rank}", "1" if holds else "0")
    return all(store.get(f"{round_keys.SHRUNK}{peer}") == b"1" for peer in range(world_size))


def init_group(shrunk, init_fresh: Callable[[object], None], *, store, rank: int, world_size: int,
               timeout: datetime.timedelta, device, backend: str, round_number: int) -> bool:
    """Form the round's default group on ``shrunk`` (this worker's shrunk communicator, or
    None) when every worker of the round holds one that fits; else ``init_fresh(group_store)``,
    today's ``init_process_group``. ``store``: the round's. True when formed on ``shrunk``.

    An exception while the shrunk one joins the group (torch's private API, which may
    change) falls back to ``init_fresh``, on a namespace of its own: the failed build's
    gloo keys are in the usual one."""
    fits = shrunk is not None and shrunk.rank() == rank and shrunk.size() == world_size
    if shrunk is not None and not fits:
        log.warning("round %d: the shrunk NCCL communicator is rank %d of %d, the round says %d of %d",
                    round_number, shrunk.rank(), shrunk.size(), rank, world_size, extra=FILE_ONLY)
    try:
        agreed = every_worker_holds_one(store, rank, world_size, fits)
    except BaseException:
        drop(shrunk)
        raise  # the round's store is gone or aborted: the round fails as an init would
    if not agreed:
        drop(shrunk)
        log.info("round %d: not every worker holds a shrunk NCCL communicator; building a new one", round_number,
                 extra=FILE_ONLY)
        init_fresh(dist.PrefixStore(round_keys.GROUP, store))
        return False
    try:
        # The host part alone, as the usual init makes it (same store keys, same group name).
        dist.init_process_group(f"cpu:{capability_of(backend).host_backend}",
                                store=dist.PrefixStore(round_keys.GROUP, store),
                                rank=rank, world_size=world_size, timeout=timeout)
    except BaseException:
        drop(shrunk)
        raise  # a peer lost meanwhile: as today's init would have failed
    try:
        attach(shrunk, device=device, backend=backend)
    except Exception as exc:  # noqa: BLE001 - the fallback is today's init
        log.warning("round %d: the shrunk NCCL communicator could not join the round's group (%s: %s); building "
                    "a new one", round_number, type(exc).__name__, exc, extra=FILE_ONLY)
        drop(shrunk)  # before the group's destroy: a live NCCL part would be finalized, which waits for peers
        try:
            dist.destroy_process_group()
        except Exception as destroy_exc:  # noqa: BLE001 - the fresh init says whether it matters
            log.debug("destroy_process_group: %s", destroy_exc)
        init_fresh(dist.PrefixStore(round_keys.GROUP_AFTER_SHRINK, store))
        return False
    log.info("round %d: formed on the shrunk NCCL communicator", round_number, extra=FILE_ONLY)
    return True


def attach(shrunk, *, device, backend: str, group=None) -> None:
    """Make ``shrunk`` the CUDA part of ``group`` (the default group, made with its host part
    alone), as ``init_process_group(backend, device_id=device)`` would have made it."""
    from torch.distributed import distributed_c10d

    group = distributed_c10d._get_default_group() if group is None else group
    # Before the registration: it hands the group's bound device to the backend, and
    # new_group splits its NCCL groups from the bound device's backend (torch 2.13,
    # ProcessGroup::setBackend, distributed_c10d._new_process_group_helper).
    group.bound_device_id = device
    group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, shrunk)
    group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)  # what a cpu:gloo,cuda:nccl group has
    world = distributed_c10d._world
    world.pg_map[group] = (backend, world.pg_map[group][1])
    world.pg_backend_config[group] = str(distributed_c10d.BackendConfig(backend))
