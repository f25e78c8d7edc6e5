"""StatefulStream: a stream whose position is opaque, committed per rank, resumed at the same world size.

A stream that keeps its own position (torchdata's ``StatefulDataLoader``, a Hugging
Face ``datasets.IterableDataset``, any iterable with ``state_dict()`` and
``load_state_dict()``) is split by rank when it is built, and its position means
something only for that rank's split. So what is exact is said plainly:

* the same world size resumes exactly: every rank's position is committed (gathered
  from all ranks after each batch is taken from the stream, before it is trained), and
  after a re-formation rank ``r`` rebuilds its split and loads rank ``r``'s position,
  whichever process held rank ``r`` before (a replacement, a renumbered survivor);
* another world size is refused in one line, before a batch is read: a position of a
  split into 4 does not say which samples of a split into 3 were trained, and going on
  would repeat or skip samples silently. Data that must resume at any world size is
  read through a ``ShardedSource``.

    def make(rank, world):
        ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        return StatefulDataLoader(split_dataset_by_node(ds, rank, world), batch_size=8, num_workers=2)

    stream = StatefulStream(make)
    state = elastic.TorchState(model=model, optimizer=opt, stream=stream, step=0)

The gather is one ``all_gather_object`` per batch on the ring (the process group the
runtime formed), so every rank must take the same number of batches: stop the loop by
a step count, not by one rank's split running dry.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist


def world_now() -> tuple[int, int]:
    """(rank, world size) of the current ring; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def refusal(committed_world: int, world: int) -> str:
    return (f"StatefulStream: its position was committed at world size {committed_world}, the ring now has "
            f"{world}: a stream's position is per rank and cannot be re-split exactly; resume with "
            f"{committed_world} workers (--min-np = --max-np), or read the data through elastic.ShardedSource, "
            f"which resumes at any world size")


def encode(position: Any) -> bytes:
    """A position as bytes that ``decode`` reads back with ``torch.load(weights_only=True)``:
    a durable checkpoint never unpickles arbitrary objects (checkpoint/restore.py), and
    neither does a resume from one."""
    buffer = io.BytesIO()
    torch.save(position, buffer)
    return buffer.getvalue()


def decode(data: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler's refusal, said in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"StatefulStream: a position holds more than tensors and plain values, which a "
                         f"resume does not unpickle: {first}") from None


def position_to_take(committed: Optional[dict], rank: int, world: int) -> Optional[bytes]:
    """Rank ``rank``'s committed position (encoded), None for the stream's start; a
    commit made at another world size raises the one-line refusal."""
    if committed is None or not committed.get("states"):
        return None
    if committed["world_size"] != world:
        raise ValueError(refusal(committed["world_size"], world))
    return committed["states"][rank]


class StatefulStream:
    """The stream of ``make(rank, world)`` (an iterable with ``state_dict()`` and
    ``load_state_dict()``), its every rank's position committed with the state."""

    def __init__(self, make: Callable[[int, int], Iterable]):
        if not callable(make):
            raise TypeError("StatefulStream takes a function make(rank, world) that builds this rank's stream")
        self.make = make
        self.stream: Any = None
        self.built_for: Optional[tuple[int, int]] = None
        self._latest: Optional[dict] = None  # every rank's position after the last batch taken
        self._checked = False  # this rank's position decodes (checked once per stream built)
        self._to_load: Optional[dict] = None  # a commit to resume from (load_state_dict)

    # -- committed state --------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"world_size", "states"}``: every rank's encoded position (empty: the start)."""
        return dict(self._latest) if self._latest is not None else {"world_size": 0, "states": []}

    def load_state_dict(self, state: dict) -> None:
        """Taken at the next iteration, on the ring that then exists (a rollback's restore
        runs before the new ring is formed)."""
        if not isinstance(state, dict) or "world_size" not in state or "states" not in state:
            raise ValueError(f"StatefulStream state needs world_size and states, got {state!r:.200}")
        self._to_load = {"world_size": int(state["world_size"]), "states": list(state["states"])}
        self._latest = dict(self._to_load) if self._to_load["states"] else None

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator:
        """Checks and loads now (a refusal comes at ``iter()``, not at the first batch)."""
        rank, world = world_now()
        committed = self._to_load if self._to_load is not None else (
            self._latest if self.built_for not in (None, (rank, world)) else None)
        position = position_to_take(committed, rank, world)  # refused here, before a batch is read
        if self.built_for != (rank, world) or self.stream is None:
            self.stream = self.make(rank, world)
            self.built_for, self._checked = (rank, world), False
        if committed is not None:
            if position is not None:
                self.stream.load_state_dict(decode(position))
            elif self._to_load is not None:  # the commit is the stream's start
                self.stream = self.make(rank, world)
        self._to_load = None
        return self._batches(world)

    def _batches(self, world: int) -> Iterator:
        for batch in self.stream:
            # Before the batch is handed out: a commit after its step counts it as trained.
            self._latest = self._gather(self.stream.state_dict(), world)
            yield batch

    def _gather(self, position: Any, world: int) -> dict:
        mine = encode(position)
        if not self._checked:  # refused at the first batch, not at a resume long after
            decode(mine)
            self._checked = True
        if world == 1:
            return {"world_size": 1, "states": [mine]}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        return {"world_size": world, "states": everyone}
