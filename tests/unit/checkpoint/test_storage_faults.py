"""Storage faults at a resume: checkpoints that exist but cannot be read are retried,
then named, never taken for corrupt and skipped (restore.py); corrupt ones still are.

Faults are injected by patching ``open``/``os.listdir`` for the paths of one checkpoint
(running as root, file modes cannot make a real directory unreadable)."""

from __future__ import annotations

import builtins
import errno
import logging
import os

import pytest
import torch

from elastic.checkpoint import CheckpointPolicy, CheckpointsUnreadable, DurableWriter, list_checkpoints, load_latest
from elastic.checkpoint import manifest as mf
from elastic.checkpoint.restore import find_newest, with_retries


def write_steps(directory, *steps, keep=10):
    with DurableWriter(CheckpointPolicy(str(directory), keep=keep)) as writer:
        for step in steps:
            assert writer.submit({"w": torch.full((8,), float(step))}, step=step)
            assert writer.flush(30) and writer.last_error is None, writer.last_error


class Storage:
    """Reads under the given paths fail with an errno while ``failing`` (a count of
    scans, or None for ever); everything else reads normally."""

    def __init__(self, monkeypatch, *paths, err=errno.EIO, listdir=False):
        self.paths = [str(p) for p in paths]
        self.err, self.calls = err, 0
        real_open, real_listdir = builtins.open, os.listdir

        def fault(path):
            path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
            if any(path == p or path.startswith(p + os.sep) for p in self.paths):
                self.calls += 1
                raise OSError(self.err, os.strerror(self.err), path)

        def open_(file, mode="r", *args, **kwargs):
            if not any(c in mode for c in "wax+"):
                fault(file)
            return real_open(file, mode, *args, **kwargs)

        def listdir_(path="."):
            fault(path)
            return real_listdir(path)

        monkeypatch.setattr(builtins, "open", open_)
        if listdir:
            monkeypatch.setattr(os, "listdir", listdir_)


class Sleeps(list):
    def __call__(self, seconds):
        self.append(seconds)


@pytest.mark.parametrize("err", [errno.EIO, errno.ESTALE, errno.EACCES])
def test_an_unreadable_newest_checkpoint_is_retried_then_named(tmp_path, monkeypatch, err):
    write_steps(tmp_path, 50, 100)
    Storage(monkeypatch, tmp_path / mf.step_dirname(100), err=err)
    sleeps = Sleeps()
    with pytest.raises(CheckpointsUnreadable) as failure:
        load_latest(str(tmp_path), delays=(1, 2, 4), sleep=sleeps)
    assert sleeps == [1, 2, 4]  # bounded: three retries, then the error
    line = str(failure.value)
    assert "\n" not in line and mf.step_dirname(100) in line and errno.errorcode[err] in line
    assert failure.value.unreadable[0][0] == str(tmp_path / mf.step_dirname(100))


def test_a_fault_that_passes_within_the_retries_loads_the_newest(tmp_path, monkeypatch):
    write_steps(tmp_path, 50, 100)
    storage = Storage(monkeypatch, tmp_path / mf.step_dirname(100))

    def sleep(seconds):  # the storage heals after the first retry
        storage.paths = []

    tree, manifest = load_latest(str(tmp_path), delays=(1, 1), sleep=sleep)
    assert manifest["step"] == 100 and tree["w"][0] == 100


def test_a_directory_that_cannot_be_listed_is_unreadable_not_empty(tmp_path, monkeypatch):
    write_steps(tmp_path, 50)
    Storage(monkeypatch, tmp_path, err=errno.EACCES, listdir=True)
    with pytest.raises(CheckpointsUnreadable, match="Permission denied"):
        load_latest(str(tmp_path), delays=(), sleep=Sleeps())


def test_a_state_file_that_cannot_be_loaded_for_an_os_error_is_unreadable(tmp_path, monkeypatch):
    write_steps(tmp_path, 50, 100)
    real_load = torch.load

    def load(path, *args, **kwargs):
        if str(tmp_path / mf.step_dirname(100)) in str(path):
            raise OSError(errno.EIO, "Input/output error")
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(CheckpointsUnreadable, match="state.pt cannot be read"):
        load_latest(str(tmp_path), delays=(), sleep=Sleeps())


def test_skip_unreadable_resumes_from_the_newest_readable_one_with_a_warning(tmp_path, monkeypatch, caplog):
    write_steps(tmp_path, 50, 100)
    Storage(monkeypatch, tmp_path / mf.step_dirname(100))
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        tree, manifest = load_latest(str(tmp_path), skip_unreadable=True, delays=(), sleep=Sleeps())
    assert manifest["step"] == 50
    assert any("unreadable" in r.getMessage() and mf.step_dirname(100) in r.getMessage() for r in caplog.records)


def test_a_corrupt_newest_checkpoint_is_still_skipped_without_retries(tmp_path, caplog):
    write_steps(tmp_path, 50, 100)
    state = tmp_path / mf.step_dirname(100) / mf.STATE_NAME
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    sleeps = Sleeps()
    tree, manifest = load_latest(str(tmp_path), delays=(1, 2), sleep=sleeps)
    assert manifest["step"] == 50 and sleeps == []


def test_unreadable_and_corrupt_together_fail_naming_only_the_unreadable(tmp_path, monkeypatch):
    write_steps(tmp_path, 50, 100, 150)
    (tmp_path / mf.step_dirname(150) / mf.MANIFEST_NAME).write_text("{")  # corrupt
    Storage(monkeypatch, tmp_path / mf.step_dirname(100))
    with pytest.raises(CheckpointsUnreadable) as failure:
        load_latest(str(tmp_path), delays=(), sleep=Sleeps())
    assert [os.path.basename(p) for p, _ in failure.value.unreadable] == [mf.step_dirname(100)]


def test_list_checkpoints_marks_unreadable_ones(tmp_path, monkeypatch):
    write_steps(tmp_path, 50, 100)
    Storage(monkeypatch, tmp_path / mf.step_dirname(100))
    infos = list_checkpoints(str(tmp_path))
    assert [(i.step, i.valid, i.unreadable) for i in infos] == [(100, False, True), (50, True, False)]


def test_find_newest_does_not_load_an_older_one_behind_an_unreadable_one(tmp_path, monkeypatch):
    write_steps(tmp_path, 50, 100)
    Storage(monkeypatch, tmp_path / mf.step_dirname(100))
    loaded = []
    with pytest.raises(CheckpointsUnreadable):
        find_newest(str(tmp_path), load=lambda info: loaded.append(info.step))
    assert loaded == []


def test_with_retries_retries_only_unreadable(tmp_path):
    calls = []

    def scan():
        calls.append(1)
        raise ValueError("not a storage fault")

    with pytest.raises(ValueError):
        with_retries(scan, delays=(1, 1), sleep=Sleeps())
    assert len(calls) == 1
