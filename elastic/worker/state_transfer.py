"""The collectives of a state sync (``State.sync``): who holds what, and moving it.

    holdings = gather_holdings(rank, commit, backend)   # all_gather of 3 integers per rank
    send_layout(layout, receivers, backend)             # holders[0]: the pickled structure ...
    layout = receive_layout(src, backend)               # ... to the receivers, point to point
    moved = run_transfers(plan, rank, buffers, backend) # the plan's slices, point to point

Holders receive nothing but the holdings: the layout goes from the first holder to
the receivers alone (a broadcast would make every other holder receive it too), and
the other holders take it from their own snapshot, which holds the same commit.

On gloo every transfer is posted at once (``isend``/``irecv``) straight from a holder's
snapshot buffer into a view of the receiver's: gloo sends from and receives into host
memory, so nothing is staged and the holders' stripes travel in parallel. NCCL only
moves device memory: each chunk is staged through one device buffer per peer, one
chunk at a time, so the device holds a chunk, never the state. A receiver takes its
transfers holder by holder (the plan's order), which keeps blocking sends free of
deadlock: a holder waits only for a receiver that is already taking that holder's
chunks.
"""

from __future__ import annotations

import pickle
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .sync_plan import CommitId, Holding, SyncPlan, Transfer

# The plan cuts stripes into chunks of at most this size: NCCL's staging buffer per
# peer, and on gloo the size of one message.
CHUNK_BYTES = 32 << 20
# The layout's messages (its size, then its bytes) are tagged apart from the transfers,
# whose tags count from 0 per (holder, receiver) pair: a receiver takes them first.
_LAYOUT_TAG = 1 << 30


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def gather_holdings(rank: int, world_size: int, commit: Optional[CommitId], backend: str) -> list[Holding]:
    """Every rank's commit identity: one all_gather of (holds, round, count)."""
    mine = torch.tensor([commit is not None, commit.round if commit else 0, commit.count if commit else 0],
                        dtype=torch.int64, device=_device(backend))
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    holdings = []
    for r, values in enumerate(everyone):
        holds, round_, count = (int(v) for v in values.cpu())
        holdings.append(Holding(r, CommitId(round_, count) if holds else None))
    assert holdings[rank].commit == commit
    return holdings


def send_layout(layout, receivers: Sequence[int], backend: str) -> None:
    """Send the newest commit's layout (structure, sizes, plain values) to ``receivers``."""
    device = _device(backend)
    body = torch.frombuffer(bytearray(pickle.dumps(layout)), dtype=torch.uint8).to(device)
    size = torch.tensor([body.numel()], dtype=torch.int64, device=device)
    # Blocking sends in the receivers' order: each receiver already waits for exactly
    # these two messages from us, so none of them waits on another (NCCL included).
    for receiver in receivers:
        dist.send(size, dst=receiver, tag=_LAYOUT_TAG)
        dist.send(body, dst=receiver, tag=_LAYOUT_TAG + 1)


def receive_layout(src: int, backend: str):
    """The layout that ``send_layout`` sends, from rank ``src``."""
    device = _device(backend)
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, src=src, tag=_LAYOUT_TAG)
    body = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(body, src=src, tag=_LAYOUT_TAG + 1)
    return pickle.loads(body.cpu().numpy().tobytes())


def run_transfers(plan: SyncPlan, rank: int, buffers: list[torch.Tensor], backend: str) -> int:
    """Send or receive this rank's share of ``plan``; returns the bytes it moved."""
    sending = rank in plan.holders
    mine = plan.sends(rank) if sending else plan.receives(rank)
    if backend == "nccl":
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
    device = _device("nccl")
    staging: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    for _, transfer in _tagged(transfers, sending):
        view = _view(buffers, transfer)
        peer = transfer.receiver if sending else transfer.holder
        key = (peer, view.dtype)
        if key not in staging:
            staging[key] = torch.empty(CHUNK_BYTES // view.element_size(), dtype=view.dtype, device=device)
        chunk = staging[key][: transfer.length]
        if sending:
            chunk.copy_(view)
            dist.send(chunk, dst=peer)
        else:
            dist.recv(chunk, src=peer)
            view.copy_(chunk)
