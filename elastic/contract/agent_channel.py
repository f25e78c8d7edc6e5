"""What a running worker tells its agent so that the agent acts: typed messages, on a channel of the agent's own.

The events log (``events.py``) is for people and tools; nothing may depend on the name
of an event there. Two things a worker says while it runs do make its agent act, and
they travel here instead, as data with a schema (as a worker's end does, ``faults.py``):

    RingBroke   the worker's ring broke and it asks for a round: the agent checks that
                the coordinator is alive, and replaces a dead one at once
                (``rendezvous/succession.py``)
    Straggler   the worker computes persistently slower than the ring's median: with
                ``--evict-stragglers`` its agent takes the host out (a graceful leave)
    RingFormed  the worker's ring of a round formed after a re-form and trains: the
                coordinator's hold before a join round (``rounds.decide``) ends, since
                a newer round no longer makes those survivors abandon theirs

The channel is one file per agent, in the agent's private scratch directory (never the
shared log directory), named to the worker by ``WorkerConfig.agent_channel``. A worker
appends one JSON line per message with ``O_APPEND`` in one ``write``, so the lines of
several workers never interleave; the agent reads what is new on each turn of its loop
(``ChannelReader``), woken by a ``ChannelBell`` as soon as a line arrives. Every line
names its host and worker: the reader takes only its own host's lines, so a file shared
by mistake cannot make one agent act on another host's failure. A line that is not a
message of this schema is skipped, never acted on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Callable, Optional, Union

if TYPE_CHECKING:
    from .worker_config import WorkerConfig

log = logging.getLogger(__name__)

SCHEMA = 1
_MAX_LINE = 4096  # a message is about 200 bytes; a longer line was not written by a worker


@dataclass(frozen=True)
class RingBroke:
    """The worker's ring broke in ``round`` and it left it (it asks for the next round)."""

    round: int
    reason: str


@dataclass(frozen=True)
class Straggler:
    """The worker is a persistent straggler in ``round`` (``elastic/worker/stragglers.py``)."""

    round: int
    rank: int
    ratio: float  # its compute time over the ring's median
    remaining: int  # the ring's workers left if every straggler host of the window left


@dataclass(frozen=True)
class RingFormed:
    """The worker's ring of ``round`` re-formed (every rank arrived) and trains again."""

    round: int


Message = Union[RingBroke, Straggler, RingFormed]
_KINDS: dict[str, type] = {"ring_broke": RingBroke, "straggler": Straggler, "ring_formed": RingFormed}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}
_TYPES = {"int": int, "str": str, "float": (int, float)}


@dataclass(frozen=True)
class Told:
    """One message as the agent reads it: who said it, and what."""

    host: str
    worker: str
    message: Message


def encode(host: str, worker: str, message: Message) -> str:
    return json.dumps({"schema": SCHEMA, "kind": _KIND_OF[type(message)], "host": host, "worker": worker,
                       **asdict(message)})


def decode(line: str) -> Optional[Told]:
    """The message of one line, or None for a line that is not one of this schema."""
    try:
        body = json.loads(line)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("schema") != SCHEMA or body.get("kind") not in _KINDS:
        return None
    host, worker = body.get("host"), body.get("worker")
    if not isinstance(host, str) or not isinstance(worker, str):
        return None
    cls = _KINDS[body["kind"]]
    values = {}
    for f in fields(cls):
        value = body.get(f.name)
        if not isinstance(value, _TYPES[f.type]) or isinstance(value, bool):
            return None
        values[f.name] = float(value) if f.type == "float" else value
    return Told(host, worker, cls(**values))


def tell_agent(config: Optional["WorkerConfig"], message: Message) -> None:
    """Send ``message`` to this worker's agent; nothing when no agent listens (a world of
    one: no config; an agent without a channel)."""
    path = config.agent_channel if config is not None else None
    if not path:
        return
    line = (encode(config.host_id, config.worker_id, message) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError as exc:  # the agent is gone (its scratch directory with it): nobody to tell
        log.debug("cannot tell the agent %s: %s", message, exc)
        return
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class ChannelReader:
    """The agent's end: ``read_new()`` returns the messages of its own host written since."""

    def __init__(self, path: str, host: str):
        self.path = path
        self._host = host
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[Told]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data, self._partial = self._partial + data, b""
        lines = data.split(b"\n")
        if lines and lines[-1]:
            self._partial = lines[-1][:_MAX_LINE]  # a line still being written (never, with one write)
        told = []
        for raw in lines[:-1]:
            item = decode(raw[:_MAX_LINE].decode(errors="replace")) if len(raw) <= _MAX_LINE else None
            if item is None:
                log.warning("agent channel: skipping a line that is not a message: %r", raw[:80])
            elif item.host != self._host:
                log.warning("agent channel: skipping %s's message from host %s (not ours)", item.worker, item.host)
            else:
                told.append(item)
        return told


class ChannelBell:
    """Rings ``ring()`` when the channel file has grown: the agent's loop otherwise reads
    it only on its next turn (up to half a second), and a message is worth acting on at
    once (a coordinator to check, a hold to end). A look is one ``stat`` every
    ``every`` seconds: a few microseconds of CPU, the file is never read here."""

    def __init__(self, path: str, ring: Callable[[], None], every: float = 0.02):
        self._path = path
        self._ring = ring
        self._every = every
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agent-channel-bell", daemon=True)

    def start(self) -> "ChannelBell":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(1.0)

    def _run(self) -> None:
        size = 0
        while not self._stopped.wait(self._every):
            try:
                now = os.stat(self._path).st_size
            except OSError:
                continue  # nothing told yet (or the scratch directory is going away)
            if now != size:
                size = now
                self._ring()
