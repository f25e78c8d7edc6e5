"""Checkpoints: in-memory snapshots for commit(), durable atomic checkpoints, loading.

    snap = Snapshot(); snap.capture(tree)              # cheap, reuses buffers
    snap.restore_into(tree)                            # in place, keeps tensor identity
    writer = DurableWriter(CheckpointPolicy("/ckpt", every_commits=100))
    if writer.due(commits): writer.submit(tree, step=step)   # background, atomic
    loaded = load_latest("/ckpt")                      # (tree, manifest) or None
"""
from .durable import CheckpointPolicy, DurableWriter, FenceRefusal
from .restore import CheckpointInfo, CheckpointsUnreadable, list_checkpoints, load_latest
from .snapshot import Layout, Snapshot, clone_tree

__all__ = [
    "CheckpointInfo",
    "CheckpointPolicy",
    "CheckpointsUnreadable",
    "DurableWriter",
    "FenceRefusal",
    "Layout",
    "Snapshot",
    "clone_tree",
    "list_checkpoints",
    "load_latest",
]
