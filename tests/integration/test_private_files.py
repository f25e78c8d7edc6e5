"""Secrets on disk go with the process that wrote them, SIGKILL included (rendezvous/private_files.py).

Real processes, real SIGKILLs: a process's private directory and the paths it registered are
removed by its reaper when it is killed; a directory whose owner and reaper are both gone is
swept by the next start; a launcher serving a secured etcd (its CA, password file, server key,
etcd data, its agent's scratch) leaves nothing behind when it is SIGKILLed."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

import pytest

from elastic.rendezvous.private_files import sweep
from tests.fakes.jobs import REPO, wait_until

pytestmark = pytest.mark.timeout(120)

_CHILD = """
import sys, time
from elastic.rendezvous import private_files
path = private_files.process_dir()
open(path + "/secret", "w").write("s")
private_files.register(sys.argv[1])
print(path, flush=True)
time.sleep(600)
"""


def _child(tmp_path, extra):
    env = {**os.environ, "ELASTIC_PRIVATE_ROOT": str(tmp_path / "root"), "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(extra)], stdout=subprocess.PIPE, env=env, text=True)
    return child, child.stdout.readline().strip()


def test_a_sigkilled_process_leaves_no_private_file(tmp_path):
    extra = tmp_path / "generated.secret"
    extra.write_text("s")
    child, path = _child(tmp_path, extra)
    assert os.path.isfile(os.path.join(path, "secret")) and os.stat(path).st_mode & 0o777 == 0o700
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    wait_until(lambda: not os.path.exists(path) and not extra.exists(), 10, "the reaper to remove them")


def test_the_next_start_sweeps_what_a_dead_owner_and_reaper_left(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    dead, alive, settingup, other = root / "111-abcd_123", root / "222-bcde_234", root / ".333-cdef_345", root / "unrelated"
    for d in (dead, alive, settingup, other):
        d.mkdir()
    for d in (dead, alive, settingup, other):
        (d / "lock").write_text("")
    held = os.open(alive / "lock", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # its owner lives (here: this test, through another open file)
    try:
        assert sweep(str(root)) == ["111-abcd_123"]
    finally:
        os.close(held)
    assert not dead.exists() and alive.exists() and settingup.exists() and other.exists()


def test_a_root_of_the_users_own_keeps_its_data_and_its_mode(tmp_path):
    # Security review 2, M6: ELASTIC_PRIVATE_ROOT naming an existing directory of the user's
    # (as the refusal message once suggested) lost every subdirectory holding an entry
    # named "lock", a file or a directory, and the directory was chmod-ed 700.
    from elastic.rendezvous.private_files import private_root
    home = tmp_path / "home"
    for name, lock_is_dir in (("thesis", False), ("webapp", True), ("1234-abcd_123", True)):
        (home / name).mkdir(parents=True)
        (home / name / "lock").mkdir() if lock_is_dir else (home / name / "lock").write_text("draft")
    (home / "photos").mkdir()
    home.chmod(0o755)
    root = private_root({"ELASTIC_PRIVATE_ROOT": str(home)})
    assert root == str(home / f"elastic-run-{os.getuid()}") and os.stat(root).st_mode & 0o777 == 0o700
    sweep(root)
    sweep(str(home))  # even pointed at the user's directory itself, the sweep keeps what is not its own
    assert sorted(os.listdir(home)) == sorted(["thesis", "webapp", "1234-abcd_123", "photos", os.path.basename(root)])
    assert (home / "thesis" / "lock").read_text() == "draft"
    assert os.stat(home).st_mode & 0o777 == 0o755


def test_a_squatted_default_root_falls_back_to_the_users_runtime_directory(tmp_path, monkeypatch):
    # Security review 2, L8: another user who made /tmp/elastic-run-<uid> first stopped
    # every launcher of this user.
    import tempfile

    from elastic.rendezvous.errors import ConfigError
    from elastic.rendezvous.private_files import private_root
    if os.getuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    tmp, runtime = tmp_path / "tmp", tmp_path / "run-user"
    tmp.mkdir()
    runtime.mkdir(mode=0o700)
    squatted = tmp / f"elastic-run-{os.getuid()}"
    squatted.mkdir()
    os.chown(squatted, 4321, 4321)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    assert private_root({"XDG_RUNTIME_DIR": str(runtime)}) == str(runtime / f"elastic-run-{os.getuid()}")
    with pytest.raises(ConfigError, match="is not a directory of this user's.*set ELASTIC_PRIVATE_ROOT"):
        private_root({})


def test_a_sigkilled_launcher_serving_a_secured_etcd_leaves_no_secret(tmp_path):
    from tests.unit.cli.test_bare_metal import _routable_address_of_ours
    from elastic.rendezvous.embedded import _free_ports
    from elastic.rendezvous.job_secret import new_secret, write_secret_file
    from tests.conftest import etcd_binary_or_skip
    from tests.fakes.jobs import Job, TRAIN_JOB

    etcd_binary_or_skip()
    address = _routable_address_of_ours()
    if address is None:
        pytest.skip("no routable address on this machine")
    root = tmp_path / "root"
    secret = write_secret_file(str(tmp_path / "job.secret"), new_secret())
    port = _free_ports(address, 1)[0]
    job = Job(tmp_path, [f"--rdzv-endpoint={address}:{port}", "--job-id", "j", "--job-secret-file", secret,
                         "--np", "1", "--host-addr", address, str(TRAIN_JOB), "--steps", "100000",
                         "--out", str(tmp_path / "out")],
              env={"ELASTIC_PRIVATE_ROOT": str(root)})
    wait_until(lambda: "worker_started" in job.text(), 90, "the worker to start")

    def files():
        return {name for _, _, names in os.walk(root) for name in names}

    assert {"job-ca.pem", "job-etcd-password", "server.key"} <= files(), files()
    # The agent's scratch (its workers' progress boards) is in there too: a killed agent
    # cannot remove it itself (216 of them were left in /tmp by the suite's kills).
    assert any(name.endswith(".progress") for name in files()), files()
    os.kill(job.proc.pid, signal.SIGKILL)  # the launcher only: its etcd and worker die with it
    job.proc.wait(10)
    wait_until(lambda: not os.listdir(root / f"elastic-run-{os.getuid()}"), 15, "its private directories to go")
    assert os.path.exists(secret)  # the user's own file is never removed
