"""elastic-run's argv: what belongs to the script, and checks made before anything starts."""

from __future__ import annotations

import os
import subprocess

import pytest

from elastic.checkpoint import owner
from elastic.cli import launch as cli
from elastic.rendezvous import ConfigError
from tests.fakes.jobs import ELASTIC_RUN, REPO


def _flags() -> list[str]:
    return sorted({flag for action in cli.build_parser()._actions for flag in action.option_strings})


def _script_args() -> list[str]:
    """Every prefix of every option we have, as an option of the script, with and without a value."""
    out = []
    for flag in _flags():
        start = 2 if flag.startswith("--") else 1
        for end in range(start + 1, len(flag) + 1):
            out += [flag[:end], "v", f"{flag[:end]}=w"]
    return out


def test_every_prefix_of_every_option_after_script_reaches_the_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    script_args = _script_args()
    assert "--checkpoint" in script_args and "--max" in script_args and "--etcd" in script_args and "-h" in script_args
    config, args = cli.parse(["--np", "1", "--backend", "gloo", str(script), *script_args])
    assert config.command == (str(script), *script_args)
    assert args.np == 1 and args.max_np is None and args.checkpoint_dir is None and not args.module


def test_script_options_after_a_module_and_after_a_double_dash(tmp_path):
    config, _ = cli.parse(["--backend=gloo", "--np", "2", "-m", "pkg.train", "--np", "5", "-m", "x"])
    assert config.command == ("-m", "pkg.train", "--np", "5", "-m", "x")
    assert config.nproc_per_node == 2
    script = tmp_path / "-odd.py"
    script.write_text("")
    os.chdir(tmp_path)
    config, _ = cli.parse(["--backend", "gloo", "--nproc", "1", "--np", "1", "--", "-odd.py", "--checkpoint", "c"])
    assert config.command == ("-odd.py", "--checkpoint", "c")


def test_launcher_abbreviations_and_errors_still_work(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    config, _ = cli.parse(["--np", "3", "--nproc", "1", "--backend", "gloo", str(script), "--np", "9"])
    assert config.nproc_per_node == 1 and config.settings.min_np == 3
    with pytest.raises(ConfigError, match="ambiguous option: --max"):
        cli.parse(["--max", "3", "--np", "1", str(script)])
    with pytest.raises(ConfigError, match="SCRIPT"):
        cli.parse(["--np", "1", "--checkpoint-dir", str(tmp_path)])


def test_end_to_end_the_script_gets_its_own_options(tmp_path):
    script = tmp_path / "echo_args.py"
    out = tmp_path / "argv.txt"
    script.write_text(f"import sys\nopen({str(out)!r}, 'w').write(repr(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["PYTHONPATH"] = str(REPO)
    script_args = ["--checkpoint", "x", "--max", "3", "--etcd", "e", "--np=7", "--rdzv", "r"]
    result = subprocess.run([*ELASTIC_RUN, "--np", "1", str(script), *script_args],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == repr(script_args)


def _read_only_mount(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)],
                                           capture_output=True).returncode != 0:
        pytest.skip("a read-only mount needs root (root ignores directory permissions)")
    return target


@pytest.mark.parametrize("kind", ["proc", "a-file", "under-a-file", "read-only"])
def test_an_unusable_checkpoint_dir_fails_before_training_with_one_line(tmp_path, kind):
    (tmp_path / "x.py").write_text("raise SystemExit('the script must not run')\n")
    (tmp_path / "file").write_text("")
    mounted = None
    if kind == "read-only":
        mounted = _read_only_mount(tmp_path)
    path = {"proc": "/proc/x", "a-file": str(tmp_path / "file"), "under-a-file": str(tmp_path / "file" / "sub"),
            "read-only": str(tmp_path / "ro" / "ckpt")}[kind]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["PYTHONPATH"] = str(REPO)
    try:
        result = subprocess.run([*ELASTIC_RUN, "--np", "1", "--checkpoint-dir", path, "x.py"],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    finally:
        if mounted is not None:
            subprocess.run(["umount", str(mounted)], check=True)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--checkpoint-dir {path} is not usable" in lines[0], result.stderr


def test_a_usable_checkpoint_dir_is_created_and_left_clean(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    target = tmp_path / "a" / "b"
    config, _ = cli.parse(["--np", "1", "--backend", "gloo", "--checkpoint-dir", str(target), str(script)])
    assert config.checkpoint["checkpoint_dir"] == str(target)
    # Nothing left but the job's claim on the directory (checkpoint/owner.py).
    assert target.is_dir() and [p.name for p in target.iterdir()] == ["job.json"]
    assert owner.owner_of(str(target)) == "local"


def test_checkpoint_storage_options_and_their_environment_forms(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    base = ["--np", "1", "--backend", "gloo", "--checkpoint-dir", str(tmp_path / "c")]
    config, _ = cli.parse([*base, str(script)])
    assert config.checkpoint["checkpoint_allow_fresh_start"] is False
    config, _ = cli.parse([*base, "--checkpoint-allow-fresh-start", str(script)])
    assert config.checkpoint["checkpoint_allow_fresh_start"] is True
    monkeypatch.setenv("ELASTIC_CHECKPOINT_ALLOW_FRESH_START", "1")
    config, _ = cli.parse([*base, str(script)])
    assert config.checkpoint["checkpoint_allow_fresh_start"] is True


def test_another_jobs_checkpoint_dir_is_refused_in_one_line_unless_taken_over(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    ckpt = tmp_path / "ckpt"
    base = ["--np", "1", "--backend", "gloo", "--checkpoint-dir", str(ckpt)]
    cli.parse([*base, "--job-id", "first", "--rdzv-endpoint", "127.0.0.1:1", str(script)])
    cli.parse([*base, "--job-id", "first", "--rdzv-endpoint", "127.0.0.1:1", str(script)])  # its own restart
    with pytest.raises(ConfigError) as refused:
        cli.parse([*base, "--job-id", "second", "--rdzv-endpoint", "127.0.0.1:1", str(script)])
    assert "belongs to job 'first'" in str(refused.value) and "\n" not in str(refused.value)
    cli.parse([*base, "--job-id", "second", "--rdzv-endpoint", "127.0.0.1:1", "--checkpoint-take-over", str(script)])
    assert owner.owner_of(str(ckpt)) == "second"


def test_a_refused_checkpoint_dir_exits_2_with_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    owner.claim(str(ckpt), "someone-else")
    (tmp_path / "x.py").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([*ELASTIC_RUN, "--np", "1", "--checkpoint-dir", str(ckpt), "x.py"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "belongs to job 'someone-else'" in lines[0], result.stderr


def test_a_new_checkpoint_dir_is_private(tmp_path):
    """docs/failures.md: checkpoint directories are created 0700 (the top one was 0755)."""
    from elastic.cli.launch import _check_writable_dir

    _check_writable_dir(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o700


def test_a_replacement_is_planned_sooner_when_it_starts_warm(tmp_path):
    """The hold after a recovery round is what a newcomer would cost the survivors who
    wait for it: a fork of the warm template, or a cold start that imports torch."""
    script = tmp_path / "train.py"
    script.write_text("")
    warm, _ = cli.parse(["--np", "2", "--backend", "gloo", str(script)])
    cold, _ = cli.parse(["--np", "2", "--backend", "gloo", "--cold-starts", str(script)])
    assert (warm.settings.recovery_hold, cold.settings.recovery_hold) == (0.5, 2.0)
