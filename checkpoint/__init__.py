"""Checkpoints: in-memory snapshots for commit(), durable atomic checkpoints, loading.

    snap = Snapshot(); snap.capture(tree)              # cheap, reuses buffers
    live = copy_into(snap.tree(), live)                # in place, keeps tensor identity
    writer = DurableWriter(CheckpointPolicy("/ckpt", every_commits=100))
    if writer.due(commits): writer.submit(tree, step=step)   # background, atomic
    loaded = load_latest("/ckpt")                      # (tree, manifest) or None
"""
from __future__ import annotations

import importlib

# Where each public name lives. They load on first use (PEP 562), so that the launcher
# and the agent, which need only ``owner`` and ``manifest``, do not import torch on their
# start path: that import is most of a process's start (issue 30). elastic/__init__.py
# loads its API the same way; this room may import nothing of elastic's, so the few
# lines are not shared.
_HOMES = {
    "CheckpointPolicy": "durable", "DurableWriter": "durable", "PublishRefusal": "durable",
    "CheckpointInfo": "restore", "CheckpointsUnreadable": "restore", "list_checkpoints": "restore",
    "load_latest": "restore",
    "Flat": "snapshot", "Layout": "snapshot", "Plain": "snapshot", "Snapshot": "snapshot", "clone_tree": "snapshot",
    "copy_into": "tree_copy",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))


__all__ = sorted(_HOMES)
