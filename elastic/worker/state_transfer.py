"""The collectives of a state sync (``State.sync``): who holds what, and moving it.

    holdings = gather_holdings(rank, commit, backend)   # all_gather of 3 integers per rank
    send_layout(layout, receivers, backend)             # holders[0]: the structure, as plain data ...
    layout = receive_layout(src, backend)               # ... to the receivers, point to point
    moved = run_transfers(plan, rank, buffers, backend) # the plan's slices, point to point

Holders receive nothing but the holdings: the layout goes from the first holder to
the receivers alone (a broadcast would make every other holder receive it too), and
the other holders take it from their own snapshot, which holds the same commit.

On gloo every transfer is posted at once (``isend``/``irecv``) straight from a holder's
snapshot buffer into a view of the receiver's: gloo sends from and receives into host
memory, so nothing is staged and the holders' stripes travel in parallel. NCCL only
moves device memory: chunks are staged through two device buffers per peer, used in
turn, so the device holds two chunks per peer, never the state. Round k posts every
peer's k-th chunk in one ``batch_isend_irecv`` on the ring's own communicator (eager
init: no pair communicators), while the copies of round k+1 fill the other buffers;
no host thread ever waits for a peer, so the order of the rounds cannot deadlock.
Chunks travel as bytes (NCCL has no complex dtypes). A "cpu:gloo,cuda:nccl" ring
moves the host buffers through its gloo part, like gloo.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..contract.devices import capability
from ..contract.errors import PeerDataInvalid
from . import layout_wire, wire
from .sync_plan import ClaimBounds, CommitId, Holding, SyncPlan, Transfer, implausible_claim

# The plan cuts stripes into chunks of at most this size: NCCL's staging buffer per
# peer, and on gloo the size of one message.
CHUNK_BYTES = 32 << 20
# The layout's messages (its size, then its bytes) are tagged apart from the transfers,
# whose tags count from 0 per (holder, receiver) pair: a receiver takes them first.
_LAYOUT_TAG = 1 << 30
# The most bytes a layout may take on the wire (it holds the plain values: a sampler's
# processed indices of a large epoch among them). A peer announcing more is refused
# before anything is allocated (layout_wire.py checks the rest).
MAX_LAYOUT_BYTES = 512 << 20


def wire_device(backend: str) -> torch.device:
    # Only a ring with no part for host tensors (pure NCCL) needs device tensors; a mixed
    # one ("cpu:gloo,cuda:nccl") sends host tensors through its gloo part.
    if capability(backend).wire_device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def claim_bounds(ring, mine: Optional[CommitId]) -> ClaimBounds:
    """What ``ring`` (a ``RingView``) knows of the commits it may claim (sync_plan.ClaimBounds)."""
    plan, previous, current = ring.plan, ring.previous_plan, ring.round
    if mine is None or plan is None or previous is None or mine.round != previous.round:
        return ClaimBounds(current, mine=mine)
    before = set(previous.worker_ids())
    members = frozenset(r for r, worker in enumerate(plan.worker_ids()) if worker in before)
    return ClaimBounds(current, previous.round, members, mine)


def gather_holdings(rank: int, world_size: int, commit: Optional[CommitId], backend: str,
                    bounds: Optional[ClaimBounds] = None) -> list[Holding]:
    """Every rank's commit identity: one all_gather of (holds, round, count). A claim the
    ring's history does not allow (``bounds``) is PeerDataInvalid, a ring failure."""
    mine = torch.tensor([commit is not None, commit.round if commit else 0, commit.count if commit else 0],
                        dtype=torch.int64, device=wire_device(backend))
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    holdings = []
    for r, values in enumerate(everyone):
        holds, round_, count = (int(v) for v in values.cpu())
        if holds not in (0, 1):
            raise PeerDataInvalid(f"rank {r} sent a malformed holding ({holds}, {round_}, {count})")
        holdings.append(Holding(r, CommitId(round_, count) if holds else None))
    assert holdings[rank].commit == commit
    why = implausible_claim(holdings, bounds) if bounds is not None else None
    if why is not None:
        raise PeerDataInvalid(f"state sync: {why}")
    return holdings


def send_layout(layout, receivers: Sequence[int], backend: str) -> None:
    """Send the newest commit's layout (structure, sizes, plain values) to ``receivers``."""
    # Blocking sends in the receivers' order: each receiver already waits for exactly
    # these two messages from us, so none of them waits on another (NCCL included).
    wire.send_bytes(layout_wire.encode(layout), receivers, wire_device(backend), _LAYOUT_TAG)


def receive_layout(src: int, backend: str, wait_s: Optional[float] = None):
    """The layout that ``send_layout`` sends, from rank ``src``, checked (layout_wire.py):
    PeerDataInvalid, a ring failure, if it is not one. ``wait_s``: how long ``src`` may
    take before it sends (it loads a durable checkpoint first), instead of the group's
    timeout (--collective-timeout): a load of tens of GB from network storage outlasts
    it, and every attempt would time out and load again. Honoured on a
    ring with a part for host tensors (gloo); pure NCCL's watchdog keeps its own."""
    data = wire.recv_bytes(src, wire_device(backend), _LAYOUT_TAG, f"state layout from rank {src}", MAX_LAYOUT_BYTES,
                           wait_s=wait_s)
    return layout_wire.decode(data, limit=MAX_LAYOUT_BYTES)


def run_transfers(plan: SyncPlan, rank: int, buffers: list[torch.Tensor], backend: str) -> int:
    """Send or receive this rank's share of ``plan``; returns the bytes it moved."""
    sending = rank in plan.holders
    mine = plan.sends(rank) if sending else plan.receives(rank)
    if capability(backend).wire_device == "cuda":
        _transfer_staged(mine, sending, buffers)
    else:
        works = []
        for tag, transfer in _tagged(mine, sending):
            view = _view(buffers, transfer)
            if sending:
                works.append(dist.isend(view, dst=transfer.receiver, tag=tag))
            else:
                works.append(dist.irecv(view, src=transfer.holder, tag=tag))
        for work in works:
            work.wait()
    return sum(t.length * buffers[t.buffer].element_size() for t in mine)


def _tagged(transfers: list[Transfer], sending: bool):
    """(tag, transfer): a running number per (holder, receiver) pair, the same on both ends."""
    counts: dict[int, int] = {}
    for transfer in transfers:
        peer = transfer.receiver if sending else transfer.holder
        counts[peer] = counts.get(peer, -1) + 1
        yield counts[peer], transfer


def _view(buffers: list[torch.Tensor], transfer: Transfer) -> torch.Tensor:
    return buffers[transfer.buffer].narrow(0, transfer.start, transfer.length)


def _transfer_staged(transfers: list[Transfer], sending: bool, buffers: list[torch.Tensor]) -> None:
    """Move ``transfers`` through two device buffers per peer, a batch of every peer's
    next chunk at a time (see the module docstring)."""
    device = wire_device("nccl")
    by_peer: dict[int, list[torch.Tensor]] = {}
    for _, transfer in _tagged(transfers, sending):
        peer = transfer.receiver if sending else transfer.holder
        by_peer.setdefault(peer, []).append(_view(buffers, transfer).view(torch.uint8))
    if not by_peer:
        return
    staging = {peer: [torch.empty(CHUNK_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
               for peer in by_peer}
    in_flight: list = []  # the previous round's works
    landed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host view, its staging slot) of that round
    for k in range(max(len(chunks) for chunks in by_peer.values())):
        ops, arriving = [], []
        for peer, chunks in by_peer.items():
            if k >= len(chunks):
                continue
            host = chunks[k]
            slot = staging[peer][k % 2][: host.numel()]
            if sending:
                # On the current stream, which the batch's NCCL stream waits for; the
                # slot's previous send (round k-2) was waited for at round k-1.
                slot.copy_(host, non_blocking=True)
                ops.append(dist.P2POp(dist.isend, slot, peer))
            else:
                ops.append(dist.P2POp(dist.irecv, slot, peer))
                arriving.append((host, slot))
        works = dist.batch_isend_irecv(ops)
        _drain(in_flight, landed)  # round k-1 ends (on the device) while round k is posted
        in_flight, landed = works, arriving
    _drain(in_flight, landed)
    torch.cuda.current_stream(device).synchronize()  # every chunk is on the host now


def _drain(works: list, landed: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make the current stream wait for ``works`` (no host wait on NCCL), then queue the
    copies of what they received to the host."""
    for work in works:
        work.wait()
    for host, slot in landed:
        host.copy_(slot, non_blocking=True)
