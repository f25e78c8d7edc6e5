"""Checkpoints: in-memory snapshots for commit(), durable atomic checkpoints, loading.

    snap = Snapshot(); snap.capture(tree)              # cheap, reuses buffers
    live = copy_into(snap.tree(), live)                # in place, keeps tensor identity
    writer = DurableWriter(CheckpointPolicy("/ckpt", every_commits=100))
    if writer.due(commits): writer.submit(tree, step=step)   # background, atomic
    loaded = load_latest("/ckpt")                      # (tree, manifest) or None
"""
from .durable import CheckpointPolicy, DurableWriter, PublishRefusal
from .restore import CheckpointInfo, CheckpointsUnreadable, list_checkpoints, load_latest
from .snapshot import Flat, Layout, Plain, Snapshot, clone_tree
from .tree_copy import copy_into

__all__ = [
    "CheckpointInfo",
    "CheckpointPolicy",
    "CheckpointsUnreadable",
    "DurableWriter",
    "PublishRefusal",
    "Flat",
    "Layout",
    "Plain",
    "Snapshot",
    "clone_tree",
    "copy_into",
    "list_checkpoints",
    "load_latest",
]
