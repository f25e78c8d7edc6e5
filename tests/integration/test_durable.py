"""Durable checkpoints on a real file system: atomic writes, keep-last-K, corruption,
failing file systems (a full tmpfs, a read-only remount), and the CLI."""
import logging
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

from elastic.checkpoint import CheckpointPolicy, DurableWriter, list_checkpoints, load_latest
from elastic.checkpoint import manifest as mf
from elastic.checkpoint.cli import main as cli_main

WAIT = 30.0  # bound on every flush


def _tree(step: int, numel: int = 1000):
    return {
        "model": {"w": torch.full((numel,), float(step)), "b": torch.arange(4, dtype=torch.float64) * step},
        "optimizer": {"state": {0: {"momentum_buffer": torch.full((numel,), -float(step))}},
                      "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": [0]}]},
        "values": {"step": step, "name": "job", "blob": b"\x00"},
    }


def _write(directory, steps, keep=3, numel=1000):
    writer = DurableWriter(CheckpointPolicy(str(directory), keep=keep))
    for step in steps:
        assert writer.submit(_tree(step, numel), step=step, epoch=step // 10, round=1, world_size=4, meta={"who": "test"})
        assert writer.flush(WAIT)
        assert writer.last_error is None
    writer.close()
    return writer


def _state_path(directory, step):
    return os.path.join(str(directory), mf.step_dirname(step), mf.STATE_NAME)


def test_write_and_load_round_trip(tmp_path):
    writer = _write(tmp_path, [7])
    assert writer.last_path == os.path.join(str(tmp_path), "step-000000007")
    tree, manifest = load_latest(str(tmp_path))
    assert torch.equal(tree["model"]["w"], torch.full((1000,), 7.0))
    assert torch.equal(tree["model"]["b"], torch.arange(4, dtype=torch.float64) * 7)
    assert torch.equal(tree["optimizer"]["state"][0]["momentum_buffer"], torch.full((1000,), -7.0))
    assert tree["values"] == {"step": 7, "name": "job", "blob": b"\x00"}
    assert tree["optimizer"]["param_groups"] == [{"lr": 0.1, "momentum": 0.9, "params": [0]}]
    assert {k: manifest[k] for k in ("format", "step", "epoch", "round", "world_size", "meta")} == {
        "format": 1, "step": 7, "epoch": 0, "round": 1, "world_size": 4, "meta": {"who": "test"}}
    assert manifest["files"][mf.STATE_NAME]["size"] == os.path.getsize(_state_path(tmp_path, 7))
    # The file itself is a plain torch.save that loads without unpickling arbitrary objects.
    plain = torch.load(_state_path(tmp_path, 7), weights_only=True)
    assert torch.equal(plain["model"]["w"], tree["model"]["w"])


def test_keeps_the_last_k(tmp_path):
    _write(tmp_path, range(1, 6), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-000000004", "step-000000005"]
    assert [info.step for info in list_checkpoints(str(tmp_path))] == [5, 4]


def test_nothing_to_load():
    assert load_latest("/nonexistent/checkpoints") is None


def test_rewriting_the_same_step_replaces_it(tmp_path):
    _write(tmp_path, [3])
    writer = DurableWriter(CheckpointPolicy(str(tmp_path)))
    writer.submit({"x": torch.ones(2)}, step=3)
    assert writer.flush(WAIT) and writer.last_error is None
    # Published under a fresh name (one rename), the older copy pruned afterwards.
    assert os.listdir(tmp_path) == ["step-000000003.1"]
    assert torch.equal(load_latest(str(tmp_path))[0]["x"], torch.ones(2))


def test_flipped_byte_falls_back_to_the_previous_with_one_warning(tmp_path, caplog):
    _write(tmp_path, [1, 2, 3])
    newest = _state_path(tmp_path, 3)
    with open(newest, "r+b") as f:
        f.seek(os.path.getsize(newest) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    caplog.set_level(logging.WARNING, logger="elastic.checkpoint")
    tree, manifest = load_latest(str(tmp_path))
    assert manifest["step"] == 2 and tree["values"]["step"] == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert os.path.dirname(newest) in message and "sha256" in message and "\n" not in message


@pytest.mark.parametrize("damage", ["truncated", "missing manifest", "garbage manifest", "missing state"])
def test_partial_or_damaged_checkpoints_are_skipped(tmp_path, caplog, damage):
    _write(tmp_path, [1, 2])
    newest_dir = os.path.join(str(tmp_path), "step-000000002")
    if damage == "truncated":
        os.truncate(_state_path(tmp_path, 2), 100)
    elif damage == "missing manifest":
        os.remove(os.path.join(newest_dir, mf.MANIFEST_NAME))
    elif damage == "garbage manifest":
        with open(os.path.join(newest_dir, mf.MANIFEST_NAME), "wb") as f:
            f.write(os.urandom(64))
    else:
        os.remove(_state_path(tmp_path, 2))
    caplog.set_level(logging.WARNING, logger="elastic.checkpoint")
    assert load_latest(str(tmp_path))[1]["step"] == 1
    assert len(caplog.records) == 1 and newest_dir in caplog.records[0].getMessage()
    infos = list_checkpoints(str(tmp_path))
    assert [(i.step, i.valid) for i in infos] == [(2, False), (1, True)] and infos[0].reason


def test_valid_checkpoint_that_is_not_weights_only_is_skipped(tmp_path, caplog):
    _write(tmp_path, [1])
    # A checksummed file that needs arbitrary unpickling (as an old or foreign writer might produce).
    bad_dir = tmp_path / "step-000000002"
    bad_dir.mkdir()
    torch.save({"obj": threading.Lock}, str(bad_dir / mf.STATE_NAME))
    size, sha = mf.file_digest(str(bad_dir / mf.STATE_NAME))
    mf.write_manifest(str(bad_dir), mf.build_manifest(step=2, files={mf.STATE_NAME: {"size": size, "sha256": sha}}, created=0.0))
    caplog.set_level(logging.WARNING, logger="elastic.checkpoint")
    assert load_latest(str(tmp_path))[1]["step"] == 1
    assert len(caplog.records) == 1 and "cannot be loaded" in caplog.records[0].getMessage()


def test_stale_tmp_dirs_are_ignored_by_loaders_and_removed_by_a_new_writer(tmp_path):
    _write(tmp_path, [1])
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=60)  # a writer process that has exited
    stale = tmp_path / f".tmp-step-000000009-deadbeef@{socket.gethostname()}:{int(gone.stdout)}"
    stale.mkdir()
    (stale / mf.STATE_NAME).write_bytes(b"partial")
    assert load_latest(str(tmp_path))[1]["step"] == 1
    assert [i.step for i in list_checkpoints(str(tmp_path))] == [1]
    DurableWriter(CheckpointPolicy(str(tmp_path)))
    assert not stale.exists()


def test_due_follows_the_policy_with_an_injected_clock(tmp_path):
    now = [100.0]
    writer = DurableWriter(CheckpointPolicy(str(tmp_path), every_commits=3, every_seconds=60), clock=lambda: now[0])
    assert [c for c in range(1, 10) if writer.due(c)] == [3, 6, 9]
    now[0] += 61
    assert writer.due(1)
    writer.submit({"x": torch.ones(1)}, step=1)
    assert writer.flush(WAIT)
    assert not writer.due(1)  # the clock restarts at each submit
    assert not DurableWriter(CheckpointPolicy(str(tmp_path))).due(100)  # no policy: only explicit submits


class _GatedWriter(DurableWriter):
    """A writer whose background write waits for a gate, to hold a write 'in flight'."""

    def __init__(self, *args, **kwargs):
        self.gate = threading.Event()
        super().__init__(*args, **kwargs)

    def _write_state(self, path):
        assert self.gate.wait(WAIT)
        return super()._write_state(path)


def test_submit_while_a_write_runs_is_skipped_and_logged_once(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="elastic.checkpoint")
    writer = _GatedWriter(CheckpointPolicy(str(tmp_path)))
    source = {"x": torch.full((10,), 1.0)}
    assert writer.submit(source, step=1)
    source["x"].fill_(99.0)  # the staging copy was taken at submit time
    assert writer.submit(source, step=2) is False
    assert writer.submit(source, step=3) is False
    assert writer.skipped == 2
    assert not writer.flush(timeout=0.05)
    writer.gate.set()
    assert writer.flush(WAIT)
    skips = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skips) == 1 and skips[0].levelno == logging.INFO
    tree, manifest = load_latest(str(tmp_path))
    assert manifest["step"] == 1 and torch.equal(tree["x"], torch.full((10,), 1.0))
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.submit(source, step=4)


# -- failing file systems ------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs: root ignores permissions, but not a full or read-only file system."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                            capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)


def _assert_failure_logged_once(caplog, writer, directory, step, errno_text):
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert directory in message and errno_text in message and "\n" not in message
    assert writer.last_error == message
    assert not [n for n in os.listdir(directory) if n.startswith(mf.TMP_PREFIX)]


def test_full_file_system_keeps_the_previous_checkpoint(tiny_tmpfs, caplog):
    directory = str(tiny_tmpfs / "ckpt")
    writer = DurableWriter(CheckpointPolicy(directory))
    assert writer.submit({"x": torch.full((100,), 1.0)}, step=1) and writer.flush(WAIT)
    assert writer.last_error is None
    caplog.set_level(logging.ERROR, logger="elastic.checkpoint")
    assert writer.submit({"x": torch.full((100_000,), 2.0)}, step=2)  # 400 KB > 64 KiB: does not raise
    assert writer.flush(WAIT)
    _assert_failure_logged_once(caplog, writer, directory, 2, "No space left on device")
    tree, manifest = load_latest(directory)
    assert manifest["step"] == 1 and torch.equal(tree["x"], torch.full((100,), 1.0))
    assert writer.submit({"x": torch.full((100,), 3.0)}, step=3) and writer.flush(WAIT)
    assert writer.last_error is None  # a later success clears it
    assert load_latest(directory)[1]["step"] == 3


def test_read_only_file_system_keeps_the_previous_checkpoint(tiny_tmpfs, caplog):
    directory = str(tiny_tmpfs / "ckpt")
    writer = DurableWriter(CheckpointPolicy(directory))
    assert writer.submit({"x": torch.full((100,), 1.0)}, step=1) and writer.flush(WAIT)
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True, timeout=30)
    caplog.set_level(logging.ERROR, logger="elastic.checkpoint")
    assert writer.submit({"x": torch.full((100,), 2.0)}, step=2)
    assert writer.flush(WAIT)
    _assert_failure_logged_once(caplog, writer, directory, 2, "Read-only file system")
    assert load_latest(directory)[1]["step"] == 1


def test_directory_under_a_regular_file_fails_without_raising(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    directory = str(blocker / "ckpt")
    caplog.set_level(logging.ERROR, logger="elastic.checkpoint")
    writer = DurableWriter(CheckpointPolicy(directory))  # does not raise either
    assert "Not a directory" in writer.last_error
    assert writer.submit({"x": torch.ones(1)}, step=1) and writer.flush(WAIT)
    assert "Not a directory" in writer.last_error and directory in writer.last_error
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2  # one per failure
    assert load_latest(directory) is None


# -- CLI -----------------------------------------------------------------------------------


def test_cli_lists_valid_and_invalid(tmp_path, capsys):
    _write(tmp_path, [1, 2])
    os.truncate(_state_path(tmp_path, 2), 10)
    assert cli_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["STEP", "CREATED", "SIZE", "NAME", "STATUS"]
    assert out[1].split()[0] == "2" and "INVALID" in out[1] and "bytes" in out[1]
    assert out[2].split()[0] == "1" and out[2].endswith(" valid")
    assert out[-1] == "1 of 2 checkpoints valid"


def test_cli_exit_1_when_nothing_is_valid(tmp_path, capsys):
    assert cli_main([str(tmp_path)]) == 1  # empty directory
    _write(tmp_path, [1])
    os.remove(os.path.join(str(tmp_path), "step-000000001", mf.MANIFEST_NAME))
    assert cli_main([str(tmp_path)]) == 1
    assert "missing manifest.json" in capsys.readouterr().out


def test_cli_missing_directory_is_exit_2_with_one_line(tmp_path):
    missing = str(tmp_path / "nope")
    result = subprocess.run([sys.executable, "-m", "checkpoint", missing], capture_output=True, text=True, timeout=60,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: checkpoint directory {missing} does not exist"]
    assert result.stdout == ""


def test_each_write_reports_its_outcome(tmp_path):
    """What the agent's metrics read (elastic/agent/metrics.py): published checkpoints
    with their size, and failed writes (here: the directory is under a regular file)."""
    told = []
    report = lambda name, **fields: told.append((name, fields))  # noqa: E731
    writer = DurableWriter(CheckpointPolicy(str(tmp_path / "ckpt")), report=report)
    assert writer.submit(_tree(7), step=7) and writer.flush(WAIT)
    [(name, fields)] = told
    assert name == "checkpoint_written" and fields["step"] == 7
    assert fields["bytes"] == os.path.getsize(_state_path(tmp_path / "ckpt", 7))
    assert fields["path"] == writer.last_path and fields["seconds"] >= 0
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    told.clear()
    failing = DurableWriter(CheckpointPolicy(str(blocker / "ckpt")), report=report)
    assert failing.submit({"x": torch.ones(1)}, step=3) and failing.flush(WAIT)
    assert [(n, f.get("step")) for n, f in told] == [("checkpoint_failed", None), ("checkpoint_failed", 3)]
    assert "Not a directory" in told[-1][1]["error"]
