"""What a sharded re-shard exchanges besides the shards, as checked plain data (no pickle).

Four messages: each rank's report of the shards it holds (all-gathered), the chosen
commit's ``CommitMeta`` (broadcast from a rank that holds it), the newest durable
checkpoint rank 0 found (sent to each rank) and, after a durable load, whether every
rank's share of its checksums matched (gathered and sent back). The first three travel
as JSON through ``elastic.worker.wire``, the last as one integer; each is checked on
arrival: a malformed or impossible one is ``PeerDataInvalid``, a ring failure.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..contract.errors import PeerDataInvalid
from ..worker import wire
from ..worker.state_transfer import wire_device
from ..worker.sync_plan import CommitId
from .modules import CommitMeta
from .reshard_plan import TensorLayout

MAX_REPORT_BYTES = 16 << 20  # a rank's report: a few integers per shard it holds
MAX_META_BYTES = 512 << 20  # module buffers and the optimizer's small state travel in the meta
# A durable resume's point-to-point messages, tagged apart from the re-shard's (from 0 per
# pair), a refill's (1 << 26), the spares' ((1 << 27) + 7), the replicas' (1 << 28) and
# State's layout (1 << 30).
_FOUND_TAG = 1 << 29
_VERDICT_TAG = _FOUND_TAG + 2


def _ints(value: Any, arity: int, what: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) != arity or any(type(v) is not int or v < 0 for v in value):
        raise PeerDataInvalid(f"{what}: expected {arity} counts, got {str(value)[:60]}")
    return tuple(value)


def gather_reports(report: tuple, world: int, current_round: int, backend: str) -> list[tuple]:
    """Every rank's (held shards, metas, pending copies), each checked (``decode_report``)."""
    data = wire.dumps([[list(t) for t in part] for part in report])
    bodies = wire.all_gather_bytes(data, world, wire_device(backend), "shard report", MAX_REPORT_BYTES)
    return [decode_report(body, rank, current_round) for rank, body in enumerate(bodies)]


def decode_report(body: bytes, rank: int, current_round: int) -> tuple:
    """A rank's report: counts only, worlds of one or more, shards inside their world, and
    no commit of a round after ``current_round``; else PeerDataInvalid."""
    what = f"shard report of rank {rank}"
    with wire.decoding(what):
        return _decode_report(body, what, current_round)


def _decode_report(body: bytes, what: str, current_round: int) -> tuple:
    parts = wire.loads(body, what, limit=MAX_REPORT_BYTES)
    if type(parts) is not list or len(parts) != 3 or any(type(p) is not list for p in parts):
        raise PeerDataInvalid(f"{what}: expected three lists")
    held = [_ints(t, 4, what) for t in parts[0]]
    metas = [_ints(t, 3, what) for t in parts[1]]
    pending = [_ints(t, 4, what) for t in parts[2]]
    for round_, _, w, shard in held + pending + [m + (0,) for m in metas]:
        if round_ > current_round or w < 1 or shard >= w:
            raise PeerDataInvalid(f"{what}: a commit of round {round_}, world {w}, shard {shard} is impossible "
                                  f"in round {current_round}")
    return held, metas, pending


# Every field of CommitMeta travels: the set comes from the dataclass, so a field added
# there cannot be dropped here unnoticed (the scheduler's state once was).
_FIELDS = frozenset(f.name for f in dataclasses.fields(CommitMeta))


def _meta_plain(meta: CommitMeta) -> dict:
    plain = {name: getattr(meta, name) for name in _FIELDS}
    plain["commit"] = [meta.commit.round, meta.commit.count]
    plain["layout"] = [[t.key, list(t.shape), t.dtype] for t in meta.layout]
    return plain


def _meta(value: Any, current_round: int) -> CommitMeta:
    what = "commit meta"
    fields = _FIELDS
    if type(value) is not dict or set(value) != fields:
        raise PeerDataInvalid(f"{what}: expected the fields {sorted(fields)}")
    round_, count = _ints(value["commit"], 2, what)
    world = value["world"]
    if round_ > current_round or type(world) is not int or world < 1:
        raise PeerDataInvalid(f"{what}: commit of round {round_} by a world of {str(world)[:20]} is impossible")
    if type(value["layout"]) is not list:
        raise PeerDataInvalid(f"{what}: the layout must be a list")
    layout = []
    for entry in value["layout"]:
        if type(entry) is not list or len(entry) != 3 or type(entry[0]) is not str or type(entry[1]) is not list:
            raise PeerDataInvalid(f"{what}: a tensor must be [key, shape, dtype]")
        wire.dtype_named(f"torch.{entry[2]}", what)
        layout.append(TensorLayout(entry[0], _ints(entry[1], len(entry[1]), what), entry[2]))
    for name, kind in (("values", dict), ("buffers", dict), ("plain_state", dict)):
        if type(value[name]) is not kind:
            raise PeerDataInvalid(f"{what}: {name} must be a {kind.__name__}")
    for name in ("sampler", "scheduler"):
        if value[name] is not None and type(value[name]) is not dict:
            raise PeerDataInvalid(f"{what}: {name} must be a dict")
    if value["groups"] is not None and (type(value["groups"]) is not list
                                        or any(type(g) is not dict for g in value["groups"])):
        raise PeerDataInvalid(f"{what}: groups must be a list of dicts")
    return CommitMeta(CommitId(round_, count), world, tuple(layout), value["values"], value["sampler"],
                      value["buffers"], value["groups"], value["plain_state"], value["scheduler"])


def broadcast_meta(meta: Optional[CommitMeta], src: int, rank: int, current_round: int,
                   backend: str) -> Optional[CommitMeta]:
    """``src``'s commit meta (or None) on every rank, checked (``decode_meta``)."""
    body = wire.broadcast_bytes(encode_meta(meta) if rank == src else None, src, rank, wire_device(backend),
                                "commit meta", MAX_META_BYTES)
    return decode_meta(body, src, current_round)


def encode_meta(meta: Optional[CommitMeta]) -> bytes:
    return wire.dumps(_meta_plain(meta) if meta is not None else None, tensors=True)


def decode_meta(body: bytes, src: int, current_round: int) -> Optional[CommitMeta]:
    what = f"commit meta from rank {src}"
    value = wire.loads(body, what, limit=MAX_META_BYTES, tensors=True)
    with wire.decoding(what):  # a slip of ours on a peer's bytes is the peer's fault
        return None if value is None else _meta(value, current_round)


def broadcast_found(found: Optional[tuple[str, dict]], rank: int, world: int, backend: str,
                    wait_s: Optional[float] = None) -> Optional[tuple[str, dict]]:
    """Rank 0's newest durable checkpoint, (path, manifest) or None, on every rank. ``wait_s``:
    how long the others wait for it, instead of the group's timeout (--collective-timeout):
    rank 0 scans the checkpoint directory first, and a file server that is slow to list
    or stat outlasts a collective. Sent point to point because gloo honours a receive's
    own timeout over the group's (wire.recv_bytes), not a broadcast's."""
    device = wire_device(backend)
    what = "durable checkpoint from rank 0"
    if rank == 0:
        body = wire.dumps(list(found) if found is not None else None)
        # Blocking sends in rank order: every other rank already waits for exactly this message.
        wire.send_bytes(body, range(1, world), device, _FOUND_TAG)
    else:
        body = wire.recv_bytes(0, device, _FOUND_TAG, what, MAX_REPORT_BYTES, wait_s=wait_s)
    value = wire.loads(body, what, limit=MAX_REPORT_BYTES)
    if value is None:
        return None
    if type(value) is not list or len(value) != 2 or type(value[0]) is not str or type(value[1]) is not dict:
        raise PeerDataInvalid(f"{what}: expected [path, manifest]")
    return value[0], value[1]


def worst_verdict(verdict: int, rank: int, world: int, backend: str, wait_s: float, codes: int) -> int:
    """The highest of every rank's ``verdict`` (a code below ``codes``) on every rank: rank 0
    gathers them and sends the answer back. Each message may take ``wait_s`` (a rank that
    verifies a large file takes that long, and gloo holds a point-to-point message's own
    timeout, not a collective's); a code out of range is PeerDataInvalid."""
    device = wire_device(backend)
    timeout = datetime.timedelta(seconds=wait_s)

    def checked(value: torch.Tensor, src: int) -> int:
        code = int(value.item())
        if not 0 <= code < codes:
            raise PeerDataInvalid(f"checkpoint verification verdict from rank {src}: {code} is no verdict")
        return code

    if rank == 0:
        theirs = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(1, world)]
        works = [dist.irecv(t, src=peer, tag=_VERDICT_TAG) for peer, t in enumerate(theirs, start=1)]
        worst = verdict
        for peer, (work, value) in enumerate(zip(works, theirs), start=1):
            work.wait(timeout)
            worst = max(worst, checked(value, peer))
        answer = torch.tensor([worst], dtype=torch.int64, device=device)
        for work in [dist.isend(answer, dst=peer, tag=_VERDICT_TAG + 1) for peer in range(1, world)]:
            work.wait(timeout)
        return worst
    dist.isend(torch.tensor([verdict], dtype=torch.int64, device=device), dst=0, tag=_VERDICT_TAG).wait(timeout)
    answer = torch.empty(1, dtype=torch.int64, device=device)
    dist.irecv(answer, src=0, tag=_VERDICT_TAG + 1).wait(timeout)
    return checked(answer, 0)
