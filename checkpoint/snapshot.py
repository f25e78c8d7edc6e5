"""In-memory snapshots of a state tree in buffers that are allocated once and reused.

A *tree* is nested dict / OrderedDict / list / tuple whose leaves are tensors or plain
values (int, float, str, bool, None, bytes). ``Snapshot.capture`` copies every tensor
into one flat buffer per (dtype, device kind); the buffers and the views into them are
kept while the layout (keys, shapes, dtypes) stays the same, so a capture is a handful
of ``copy_`` calls and no allocation. Copying into reused memory is what makes
``commit()`` cheap: a fresh ``clone`` pays for page faults on every call.

CUDA tensors are copied into pinned host memory with non-blocking copies on a side
stream, so a snapshot always lives on the host and survives the loss of the device's
process group. A tree with CUDA tensors gets two sets of buffers: ``capture`` fills
the one not holding the last completed capture and returns without waiting for the
copy (the training stream waits for it on the device, so the next step cannot
overwrite what is being copied); the new capture becomes what ``tree()`` reads
once its copy has completed (an event, waited for there and at
the next capture). Pinned buffers have exactly the layout's size: host memory is
registered with CUDA (``cudaHostRegister``) instead of taken from the caching host
allocator, which rounds every block up to a power of two and keeps it for ever.
"""
from __future__ import annotations

import copy
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from . import host_pinning

__all__ = ["Snapshot", "Flat", "Plain", "Layout", "TensorSpec", "clone_tree", "format_path"]

_ATOM_TYPES = frozenset({int, float, str, bool, bytes, type(None)})
# Each tensor region starts on a 64-byte boundary so that vectorized copies stay aligned.
_ALIGN_BYTES = 64

# Tree definitions ("treedef") are nested tuples that compare with ==:
#   ("T",)                        a tensor leaf (next tensor in walk order)
#   ("P",)                        a plain leaf (next plain value in walk order)
#   ("D", keys, children)         a dict
#   ("O", keys, children, meta)   an OrderedDict; meta is its `_metadata` (state_dict versions)
#   ("L", children) / ("U", children)   a list / a tuple
_TENSOR = ("T",)
_PLAIN = ("P",)


def format_path(path: tuple) -> str:
    """'model/fc.weight' style name of a path of keys, for error messages."""
    return "/".join(str(k) for k in path) or "<root>"


def _is_atom(value: Any) -> bool:
    return type(value) in _ATOM_TYPES


def _all_atoms(values) -> bool:
    return set(map(type, values)) <= _ATOM_TYPES


def _copy_plain(value: Any) -> Any:
    kind = type(value)
    if kind in _ATOM_TYPES:
        return value  # immutable
    if kind is list or kind is tuple:
        # cheap even for a long list of sample indices
        return kind(value) if _all_atoms(value) else kind(_copy_plain(v) for v in value)
    if kind is dict:  # an optimizer's param_groups, a sampler's state: no deepcopy's memo walk
        return {k: _copy_plain(v) for k, v in value.items()}
    return copy.deepcopy(value)


class Plain:
    """A value known to hold no tensor: one plain leaf, copied at capture, never walked."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class Flat:
    """A subtree of tensors only, flattened once and captured again and again: a commit
    hands the same ``Flat`` while its tensors are the same live objects (``elastic/live_tree.py``)."""

    __slots__ = ("treedef", "tensors", "paths", "signature")

    def __init__(self, tree: Any) -> None:
        tensors: list = []
        plains: list = []
        self.treedef, _ = _flatten(tree, (), tensors, plains)
        if plains:
            raise ValueError("a Flat holds tensors only")
        self.tensors = tensors
        self.paths = tuple(p for p, _ in _iter_tensors(tree))
        self.signature = tuple((t.shape, t.dtype, t.is_cuda) for t in tensors)


def _flatten(value: Any, path: tuple, tensors: list, plains: list, sigs: list | None = None) -> tuple[tuple, bool]:
    """Return (treedef, contains_tensor), appending leaves to `tensors` / `plains` (and
    each tensor's, or each ``Flat``'s, part of the layout's signature to ``sigs``).

    A container without any tensor becomes one plain leaf, so a sampler's list of a
    million indices costs one list copy instead of a million tree nodes.
    """
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise ValueError(f"unsupported tensor layout {value.layout} at {format_path(path)}")
        tensors.append(value)
        if sigs is not None:
            sigs.append((value.shape, value.dtype, value.is_cuda))
        return _TENSOR, True
    kind = type(value)
    if kind is Plain:
        plains.append(value.value)
        return _PLAIN, False
    if kind is Flat:
        tensors.extend(value.tensors)
        if sigs is not None:
            sigs.append(value.signature)
        return value.treedef, bool(value.tensors)
    if kind in _ATOM_TYPES:
        plains.append(value)
        return _PLAIN, False
    if kind in (list, tuple) and _all_atoms(value):
        plains.append(value)
        return _PLAIN, False
    start = len(plains)
    if kind is dict or kind is OrderedDict:
        keys = tuple(value.keys())
        for key in keys:
            if not _is_atom(key):
                raise ValueError(f"unsupported dict key {key!r} at {format_path(path)}")
        children = [_flatten(value[k], path + (k,), tensors, plains, sigs) for k in keys]
        has_tensor = any(c[1] for c in children)
        if not has_tensor:
            del plains[start:]
            plains.append(value)
            return _PLAIN, False
        defs = tuple(c[0] for c in children)
        if kind is OrderedDict:
            meta = getattr(value, "_metadata", None)
            return ("O", keys, defs, copy.deepcopy(meta)), True
        return ("D", keys, defs), True
    if kind is list or kind is tuple:
        children = [_flatten(v, path + (i,), tensors, plains, sigs) for i, v in enumerate(value)]
        if not any(c[1] for c in children):
            del plains[start:]
            plains.append(value)
            return _PLAIN, False
        return ("L" if kind is list else "U", tuple(c[0] for c in children)), True
    raise ValueError(
        f"unsupported value of type {kind.__module__}.{kind.__qualname__} at {format_path(path)}: "
        "leaves must be tensors or int/float/str/bool/None/bytes"
    )


def _unflatten(treedef: tuple, tensors: Iterator, plains: Iterator) -> Any:
    tag = treedef[0]
    if tag == "T":
        return next(tensors)
    if tag == "P":
        return _copy_plain(next(plains))
    if tag == "D" or tag == "O":
        out = dict() if tag == "D" else OrderedDict()
        for key, child in zip(treedef[1], treedef[2]):
            out[key] = _unflatten(child, tensors, plains)
        if tag == "O" and treedef[3] is not None:
            out._metadata = copy.deepcopy(treedef[3])
        return out
    children = [_unflatten(c, tensors, plains) for c in treedef[1]]
    return children if tag == "L" else tuple(children)


def _iter_tensors(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(path, tensor) for every tensor of a tree, in the same order as `_flatten`.

    Lenient: leaves of any other type are skipped (used on restore targets).
    """
    if isinstance(value, torch.Tensor):
        yield path, value
    elif type(value) is Flat:
        for inner, tensor in zip(value.paths, value.tensors):
            yield path + inner, tensor
    elif isinstance(value, dict):
        for key, child in value.items():
            yield from _iter_tensors(child, path + (key,))
    elif type(value) in (list, tuple):
        for i, child in enumerate(value):
            yield from _iter_tensors(child, path + (i,))


def _device_kind(t: torch.Tensor) -> str:
    return "cuda" if t.is_cuda else "cpu"


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor of the tree lives inside the flat buffers."""

    path: tuple
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # device kind of the source tensor: "cpu" or "cuda"
    buffer: int  # index into Layout.buffers
    offset: int  # in elements


@dataclass(frozen=True)
class Layout:
    """Description of a snapshot: structure, tensor specs, plain values.

    A newcomer receives this (as checked plain data: ``elastic/worker/layout_wire.py``,
    never a pickle), adopts it (``Snapshot.adopt_layout``), receives the buffers and
    reads ``.tree()``.
    """

    treedef: tuple
    tensors: tuple[TensorSpec, ...]
    buffers: tuple[tuple[torch.dtype, str, int], ...]  # (dtype, device kind, numel)
    plains: tuple


def _plan(tensors: list[torch.Tensor], paths: list[tuple]) -> tuple:
    """Assign each tensor a buffer and an aligned offset. Returns (specs, buffer descriptions)."""
    buffer_index: dict[tuple[torch.dtype, str], int] = {}
    sizes: list[int] = []
    buffers: list[tuple[torch.dtype, str]] = []
    specs = []
    for path, t in zip(paths, tensors):
        key = (t.dtype, _device_kind(t))
        if key not in buffer_index:
            buffer_index[key] = len(buffers)
            buffers.append(key)
            sizes.append(0)
        b = buffer_index[key]
        align = max(1, _ALIGN_BYTES // t.element_size())
        offset = -(-sizes[b] // align) * align
        specs.append(TensorSpec(path, tuple(t.shape), t.dtype, key[1], b, offset))
        sizes[b] = offset + t.numel()
    descs = tuple((dtype, kind, size) for (dtype, kind), size in zip(buffers, sizes))
    return tuple(specs), descs


class _Bank:
    """One set of buffers for a layout, the views of the tree's tensors into them, and
    the plain values captured with them."""

    def __init__(self, specs: tuple, descs: tuple, registered: list) -> None:
        pin = torch.cuda.is_available()
        # zeros, not empty: alignment padding ends up in durable files; keep it deterministic.
        self.buffers = [_host_buffer(numel, dtype, pin and kind == "cuda", registered) for dtype, kind, numel in descs]
        self.views = [self.buffers[s.buffer].narrow(0, s.offset, _numel(s.shape)).view(s.shape) for s in specs]
        # Per buffer: (device kind, views into it, indices of the tree's tensors that go there).
        self.groups: list[tuple[str, list[torch.Tensor], list[int]]] = []
        for b, (_, kind, _) in enumerate(descs):
            idx = [i for i, s in enumerate(specs) if s.buffer == b]
            self.groups.append((kind, [self.views[i] for i in idx], idx))
        self.plains: list = []


class Snapshot:
    """A copy of a tree in buffers allocated once and reused by every capture."""

    def __init__(self) -> None:
        self._treedef: tuple | None = None
        self._signature: tuple | None = None
        self._specs: tuple[TensorSpec, ...] = ()
        self._buffer_descs: tuple = ()
        self._front: _Bank | None = None  # the last completed capture
        self._back: _Bank | None = None  # CUDA layouts: the next capture's (in flight while _pending)
        self._pending: list | None = None  # events of the copies into _back
        self._streams: dict[torch.device, Any] = {}
        self._registered: list[int] = []  # host memory registered with CUDA, unregistered when the snapshot goes
        # Commits that do not drain the device (device_snapshot.OverlappedCopy, opt-in): None here.
        self.overlap = None
        weakref.finalize(self, _unregister, self._registered)

    @property
    def _buffers(self) -> list[torch.Tensor]:
        return self._front.buffers if self._front is not None else []

    @property
    def _views(self) -> list[torch.Tensor]:
        return self._front.views if self._front is not None else []

    @property
    def _plains(self) -> list:
        return self._front.plains if self._front is not None else []

    # -- allocation ---------------------------------------------------------------------

    def _allocate(self, treedef: tuple, specs: tuple[TensorSpec, ...], descs: tuple) -> None:
        # Let go of the old buffers first: a layout change (an optimizer's first step
        # creates its state) must not hold two snapshots at once, hundreds of MB each.
        self._settle()  # no copy may still write into them
        _unregister(self._registered)  # before the memory can be freed (views handed out stay valid)
        self._front = self._back = None
        if torch.cuda.is_available() and torch.cuda.is_initialized() and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # give back what the caching host allocator kept of the old layout
        self._front = _Bank(specs, descs, self._registered)
        if any(kind == "cuda" for _, kind, _ in descs):
            self._back = _Bank(specs, descs, self._registered)
        self._treedef = treedef
        self._specs = specs
        self._buffer_descs = descs

    # -- capture ------------------------------------------------------------------------

    @staticmethod
    def check_tree(tree: Any, path: tuple = ()) -> None:
        """Raise ValueError, naming the place, if ``capture`` could not hold ``tree``."""
        _flatten(tree, path, [], [])

    def capture(self, tree: Any) -> None:
        """Copy `tree` into the buffers (re-allocated only when the layout changed)."""
        tensors: list[torch.Tensor] = []
        plains: list = []
        sigs: list = []
        treedef, _ = _flatten(tree, (), tensors, plains, sigs)
        signature = (treedef, sigs)
        if signature != self._signature:
            paths = [p for p, _ in _iter_tensors(tree)]
            specs, descs = _plan(tensors, paths)
            self._signature = None  # stays invalid if allocation fails half-way
            self._allocate(treedef, specs, descs)
            self._signature = signature
        if self._back is None:  # host tensors only: copied now, nothing in flight
            with torch.no_grad():
                self._copy_in(self._front, tensors)
            self._front.plains = [_copy_plain(v) for v in plains]
            return
        self._settle()  # the previous capture is complete: it stays readable meanwhile
        bank = self._back
        with torch.no_grad():
            self._pending = self._copy_in(bank, tensors)
        bank.plains = [_copy_plain(v) for v in plains]

    def _copy_in(self, bank: _Bank, tensors: list[torch.Tensor]) -> list:
        """Copy into ``bank``; returns the events of its device-to-host copies."""
        # Launch the device->host copies first so they overlap with the host copies.
        events = []
        for kind, views, idx in bank.groups:
            if kind == "cuda":
                events.extend(self._copy_from_cuda(views, [tensors[i] for i in idx]))
        for kind, views, idx in bank.groups:
            if kind != "cuda" and views:
                _copy_all(views, [tensors[i] for i in idx])
        return events

    def _copy_from_cuda(self, views: list[torch.Tensor], srcs: list[torch.Tensor]) -> list:
        """Non-blocking copies into pinned memory on one side stream per device; an
        event per device that the training stream waits for (on the device, not the host)."""
        if self.overlap is not None:  # the bulk waited for by the next optimizer step instead
            self.overlap.settle_if_done = self._settle_if_done
            return self.overlap.copy(views, srcs)
        by_device: dict[torch.device, tuple[list, list]] = {}
        for dst, src in zip(views, srcs):
            pair = by_device.setdefault(src.device, ([], []))
            pair[0].append(dst)
            pair[1].append(src)
        events = []
        for device, (dsts, device_srcs) in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            current = torch.cuda.current_stream(device)
            # The side stream must see every write the training stream queued before commit().
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for dst, src in zip(dsts, device_srcs):
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            # ... and the training stream writes nothing the copy still reads.
            current.wait_event(event)
            events.append(event)
        return events

    def _settle(self) -> None:
        """Wait for the capture in flight, if any; it becomes the one that is read."""
        if self._pending is None:
            return
        events, self._pending = self._pending, None
        for event in events:
            event.synchronize()
        if self.overlap is not None and not self.overlap.promotes():
            return  # made on a ring that failed meanwhile: the previous capture stays the one read
        self._front, self._back = self._back, self._front

    def _settle_if_done(self) -> None:
        """``_settle`` if the capture in flight has completed its copy (never waits)."""
        if self._pending is not None and all(event.query() for event in self._pending):
            self._settle()

    # -- reading ------------------------------------------------------------------------

    @property
    def empty(self) -> bool:
        return self._treedef is None

    def tree(self) -> Any:
        """The captured tree; tensors are views into the buffers (callers must not mutate)."""
        if self._treedef is None:
            raise ValueError("snapshot is empty: nothing was captured")
        self._settle()
        return _unflatten(self._treedef, iter(self._views), iter(self._plains))

    def cuda_paths(self) -> frozenset:
        """Paths of the tensors that were CUDA tensors when captured: the snapshot holds
        host copies, and a restore puts these back on the device (``elastic/state.py``)."""
        return frozenset(s.path for s in self._specs if s.kind == "cuda")

    def buffers(self) -> list[torch.Tensor]:
        """The flat buffers in a deterministic order (the order of first appearance in the tree)."""
        self._settle()
        return list(self._buffers)

    def layout(self) -> Layout:
        if self._treedef is None:
            raise ValueError("snapshot is empty: nothing was captured")
        self._settle()
        return Layout(self._treedef, self._specs, self._buffer_descs, tuple(self._plains))

    def adopt_layout(self, layout: Layout) -> None:
        """Take `layout`'s structure and plain values, ready to receive its buffers.

        The buffers are kept (with whatever they hold) when their sizes and the tensor
        specs are unchanged, so a receiver that syncs again and again allocates once.
        """
        self._settle()
        if self._specs != layout.tensors or self._buffer_descs != layout.buffers or self._front is None:
            self._signature = None  # stays invalid if allocation fails half-way
            self._allocate(layout.treedef, layout.tensors, layout.buffers)
        self._treedef = layout.treedef
        self._front.plains = [_copy_plain(v) for v in layout.plains]
        self._signature = (layout.treedef, [(torch.Size(s.shape), s.dtype, s.kind == "cuda") for s in layout.tensors])


def _host_buffer(numel: int, dtype: torch.dtype, pinned: bool, registered: list) -> torch.Tensor:
    """A zeroed host buffer; ``pinned``: page-locked at exactly its size (registered with
    CUDA, its address appended to ``registered``), else from the pinned allocator."""
    buffer = torch.zeros(numel, dtype=dtype)
    if not pinned or numel == 0:
        return buffer
    # A refusal leaves no CUDA error behind (host_pinning.py, gpu review N3).
    if host_pinning.register(buffer):
        registered.append(buffer.data_ptr())
        return buffer
    return buffer.pin_memory()  # rounded up by the caching host allocator, but pinned


def _unregister(registered: list) -> None:
    """Unpin host memory registered by ``_host_buffer`` (before it can be freed)."""
    while registered:
        pointer = registered.pop()
        try:
            torch.cuda.cudart().cudaHostUnregister(pointer)
        except Exception:  # noqa: BLE001 - at exit CUDA may be gone already
            pass


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    # One call for the whole list: no Python overhead per tensor (matters for models
    # with hundreds of small tensors).
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dsts, srcs)
    else:  # pragma: no cover - older torch
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)


def clone_tree(tree: Any) -> Any:
    """Deep copy of a tree with fresh tensors (never aliasing snapshot buffers)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    kind = type(tree)
    if kind is dict or kind is OrderedDict:
        out = kind((k, clone_tree(v)) for k, v in tree.items())
        meta = getattr(tree, "_metadata", None)
        if meta is not None:
            out._metadata = copy.deepcopy(meta)
        return out
    if kind is list or kind is tuple:
        return kind(clone_tree(v) for v in tree)
    return copy.deepcopy(tree)
