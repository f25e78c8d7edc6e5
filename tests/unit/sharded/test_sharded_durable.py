"""The sharded writer's publishing (rank 0's thread) on real files, without a ring:
temporaries never outlive a failed write, everything is fsynced before the rename,
the publish check is asked around it, and a prune never reads a checkpoint back."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from concurrent.futures import Future

import pytest
import torch

from elastic.checkpoint import CheckpointPolicy, CheckpointsUnreadable, PublishRefusal, list_checkpoints
from elastic.checkpoint import manifest as mf
from elastic.checkpoint import restore
from elastic.sharded import durable, resume_check
from tests.unit.checkpoint.test_storage_faults import Storage


def done(error=None) -> Future:
    future = Future()
    future.set_exception(error) if error is not None else future.set_result(None)
    return future


def temporary(directory, step, shard=b"shard bytes") -> str:
    path = os.path.join(directory, f"{mf.TMP_PREFIX}{mf.step_dirname(step)}-r1@{socket.gethostname()}:{os.getpid()}")
    os.makedirs(path)
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(shard)
    return path


def publish(writer, step, future=None, still_current=None):
    tmp = temporary(writer.policy.directory, step)
    writer._publish(future or done(), tmp, {"values": {"epoch": 0}, "commits": step}, step, 1, 2, still_current)
    return tmp


def published(directory):
    return [os.path.basename(c.path) for c in list_checkpoints(str(directory)) if c.valid]


def test_a_failed_write_leaves_no_temporary(tmp_path):
    writer = durable.ShardedCheckpoints(CheckpointPolicy(str(tmp_path)))
    tmp = publish(writer, 5, future=done(OSError(errno.ENOSPC, "No space left on device")))
    assert not os.path.exists(tmp) and published(tmp_path) == []
    assert isinstance(writer.last_error, OSError)


def test_files_and_the_temporary_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_rename, real_fsync_dir = os.fsync, os.rename, mf.fsync_dir
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "rename", lambda a, b: (calls.append(("rename", a)), real_rename(a, b)))
    monkeypatch.setattr(mf, "fsync_dir", lambda p: (calls.append(("fsync_dir", p)), real_fsync_dir(p)))
    writer = durable.ShardedCheckpoints(CheckpointPolicy(str(tmp_path)))
    tmp = publish(writer, 5)
    rename = calls.index(("rename", tmp))
    before = calls[:rename]
    assert ("fsync", os.path.join(tmp, mf.STATE_NAME)) in before
    assert ("fsync", os.path.join(tmp, mf.MANIFEST_NAME)) in before
    assert ("fsync_dir", tmp) in before
    assert ("fsync_dir", str(tmp_path)) in calls[rename:]
    assert published(tmp_path) == [mf.step_dirname(5)]
    # the job's user only
    final = tmp_path / mf.step_dirname(5)
    assert os.stat(final).st_mode & 0o777 == 0o700
    assert {os.stat(final / n).st_mode & 0o777 for n in os.listdir(final)} == {0o600}


def test_a_prune_goes_by_name_and_reads_only_the_new_checkpoint(tmp_path, monkeypatch):
    writer = durable.ShardedCheckpoints(CheckpointPolicy(str(tmp_path), keep=2))
    for step in (5, 10):
        publish(writer, step)
    read = []
    real_digest = mf.file_digest
    monkeypatch.setattr(mf, "file_digest", lambda path: (read.append(path), real_digest(path))[1])
    tmp = publish(writer, 15)
    assert read and all(path.startswith(tmp + os.sep) for path in read)
    assert sorted(os.listdir(tmp_path)) == [mf.step_dirname(10), mf.step_dirname(15)]


def test_the_fence_is_asked_before_and_after_the_rename(tmp_path):
    writer = durable.ShardedCheckpoints(CheckpointPolicy(str(tmp_path)))

    def refuse():
        raise PublishRefusal("round 2 went on without this worker")

    tmp = publish(writer, 5, still_current=refuse)
    assert not os.path.exists(tmp) and published(tmp_path) == []
    answers = iter([True, False])
    tmp = publish(writer, 10, still_current=lambda: next(answers))
    assert "taken back right after publishing" in str(writer.last_error)
    assert not os.path.exists(tmp) and os.listdir(tmp_path) == []


def test_an_earlier_runs_newer_step_is_neither_superseded_nor_pruned(tmp_path):
    earlier = durable.ShardedCheckpoints(CheckpointPolicy(str(tmp_path), keep=1))
    publish(earlier, 10)
    fresh = durable.ShardedCheckpoints(CheckpointPolicy(str(tmp_path), keep=1))
    fresh.resumed_from = -1  # started from the initial state
    publish(fresh, 10)
    assert "not superseding" in str(fresh.last_error)
    publish(fresh, 5)
    publish(fresh, 20)
    assert sorted(os.listdir(tmp_path)) == [mf.step_dirname(10), mf.step_dirname(20)]


def test_temporaries_of_writers_that_are_gone_are_removed_at_the_first_write(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dead = tmp_path / f"{mf.TMP_PREFIX}{mf.step_dirname(5)}-r1@{socket.gethostname()}:{gone}"
    live = tmp_path / f"{mf.TMP_PREFIX}{mf.step_dirname(5)}-r2@{socket.gethostname()}:{os.getpid()}"
    for path in (dead, live):
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"partial")
    writer = durable.ShardedCheckpoints(CheckpointPolicy(str(tmp_path)))
    writer._sweep()
    assert not dead.exists() and live.exists()


def test_unreadable_sharded_checkpoints_are_retried_then_named(tmp_path, monkeypatch):
    writer = durable.ShardedCheckpoints(CheckpointPolicy(str(tmp_path)))
    publish(writer, 5)
    publish(writer, 10)
    Storage(monkeypatch, tmp_path / mf.step_dirname(10))
    sleeps = []
    with pytest.raises(CheckpointsUnreadable, match=mf.step_dirname(10)):
        resume_check.newest_valid(str(tmp_path), delays=(1, 2), sleep=sleeps.append)
    assert sleeps == [1, 2]
    path, manifest = resume_check.newest_valid(str(tmp_path), skip_unreadable=True, delays=())
    assert manifest["step"] == 5
    monkeypatch.setattr(restore, "RETRY_DELAYS", ())
    with pytest.raises(CheckpointsUnreadable, match="--checkpoint-allow-fresh-start"):
        resume_check.newest_for_resume(CheckpointPolicy(str(tmp_path)))
