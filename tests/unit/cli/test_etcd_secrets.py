"""The etcd password and TLS options (cli/etcd_secrets.py): tables of what is accepted, warned about or refused."""

from __future__ import annotations

import logging
import os

import pytest

from elastic.cli import launch as cli
from elastic.cli.etcd_secrets import check_transport, secret_source
from elastic.rendezvous import ConfigError
from elastic.rendezvous.job_secret import JobSecret, new_secret, read_secret_file, write_secret_file


@pytest.mark.parametrize("endpoints, ca, password, insecure, refused", [
    ("e:2379", None, False, False, None),
    ("e:2379", None, True, False, "cleartext"),
    ("e:2379", None, True, True, None),
    ("e:2379", "ca.pem", True, False, None),
    ("https://e:2379", None, False, False, "no --etcd-ca"),
    ("e:1,https://f:2", None, False, False, "no --etcd-ca"),
    ("https://e:2379", None, True, True, None),
    ("https://e:2379", "ca.pem", True, False, None),
    ("http://e:2379", None, False, False, None),
])
def test_what_the_transport_check_refuses(endpoints, ca, password, insecure, refused):
    if refused is None:
        check_transport(endpoints=endpoints, ca=ca, password=password, allow_insecure=insecure)
    else:
        with pytest.raises(ConfigError, match=refused):
            check_transport(endpoints=endpoints, ca=ca, password=password, allow_insecure=insecure)


def _file(tmp_path, text: str, mode: int) -> str:
    path = tmp_path / f"pw-{mode:o}"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def _parse(tmp_path, monkeypatch, argv, env=None):
    for name in list(os.environ):
        if name.startswith(("SLURM", "ELASTIC_")):
            monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    (tmp_path / "ca.pem").write_text("")
    script = tmp_path / "t.py"
    script.write_text("")
    return cli.parse(["--rdzv-endpoint", "e:2379", "--job-id", "j", "--np", "1", "--backend", "gloo",
                      "--host-addr", "127.0.0.1", "--etcd-user", "u", *argv, str(script)])


@pytest.mark.parametrize("how", ["file", "file-env", "inline-env", "inline-argv"])
def test_workers_get_a_0600_file_never_the_password(tmp_path, monkeypatch, caplog, how):
    ca = ["--etcd-ca", str(tmp_path / "ca.pem")]
    argv, env = {
        "file": ([*ca, "--etcd-password-file", _file(tmp_path, "s3cret\n", 0o600)], {}),
        "file-env": (ca, {"ELASTIC_ETCD_PASSWORD_FILE": _file(tmp_path, "s3cret", 0o600)}),
        "inline-env": (ca, {"ELASTIC_ETCD_PASSWORD": "s3cret"}),
        "inline-argv": ([*ca, "--etcd-password", "s3cret"], {}),
    }[how]
    with caplog.at_level(logging.WARNING):
        config, args = _parse(tmp_path, monkeypatch, argv, env)
    assert args.etcd_password == "s3cret"
    options = config.etcd_options
    assert "etcd_password" not in options and "s3cret" not in repr(options)
    assert os.stat(options["etcd_password_file"]).st_mode & 0o777 == 0o600
    with open(options["etcd_password_file"]) as f:
        assert f.read().rstrip("\n") == "s3cret"
    warned = [r.getMessage() for r in caplog.records if "visible to every user" in r.getMessage()]
    assert bool(warned) == (how == "inline-argv")


@pytest.mark.parametrize("argv, refused", [
    (["--etcd-password", "p"], "cleartext"),
    (["--etcd-password-file", "{pw600}"], "cleartext"),
    (["--etcd-password-file", "{pw644}", "--allow-insecure"], "can be read by other users"),
    (["--etcd-password-file", "{missing}", "--allow-insecure"], "No such file"),
    (["--etcd-password-file", "{empty}", "--allow-insecure"], "is empty"),
    (["--etcd-password", "p", "--etcd-password-file", "{pw600}", "--allow-insecure"], "not both"),
])
def test_bad_password_options_are_one_line(tmp_path, monkeypatch, argv, refused):
    paths = {"pw600": _file(tmp_path, "p", 0o600), "pw644": _file(tmp_path, "p", 0o644),
             "missing": str(tmp_path / "nope"), "empty": _file(tmp_path, "", 0o400)}
    with pytest.raises(ConfigError, match=refused):
        _parse(tmp_path, monkeypatch, [a.format(**paths) for a in argv])


def test_allow_insecure_accepts_a_password_without_tls(tmp_path, monkeypatch):
    config, _ = _parse(tmp_path, monkeypatch, ["--etcd-password", "p", "--allow-insecure"])
    assert config.etcd_options["etcd_user"] == "u"


def test_a_job_secret_gives_the_same_ca_and_password_on_every_host_and_its_file_must_be_private(tmp_path):
    secret = new_secret()
    one, other = JobSecret(secret), JobSecret(secret)
    assert one.password == other.password and one.root_password != one.password
    from cryptography import x509
    keys = [x509.load_pem_x509_certificate(js.ca_pem()).public_key().public_numbers() for js in (one, other)]
    assert keys[0] == keys[1]  # another host trusts the very same CA key
    assert JobSecret(new_secret()).password != one.password
    path = str(tmp_path / "secret")
    write_secret_file(path, secret)
    assert read_secret_file(path) == secret
    os.chmod(path, 0o604)
    with pytest.raises(ConfigError, match="can be read by other users"):
        read_secret_file(path)
    with pytest.raises(ConfigError, match="too short"):
        JobSecret("abc")


def _parse_bare(tmp_path, monkeypatch, argv, env=None):
    """A bare-metal command: no etcd options of the user's."""
    for name in list(os.environ):
        if name.startswith(("SLURM", "ELASTIC_")):
            monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "t.py"
    script.write_text("")
    return cli.parse(["--rdzv-endpoint", "10.0.0.5:29400", "--job-id", "j", "--np", "1", "--backend", "gloo",
                      "--host-addr", "127.0.0.1", *argv, str(script)])


@pytest.mark.parametrize("how", ["option", "env-file", "env-secret"])
def test_every_host_given_the_job_secret_gets_its_ca_and_a_password_file(tmp_path, monkeypatch, how):
    secret = new_secret()
    path = write_secret_file(str(tmp_path / "job.secret"), secret)
    argv, env = {"option": (["--job-secret-file", path], {}),
                 "env-file": ([], {"ELASTIC_JOB_SECRET_FILE": path}),
                 "env-secret": ([], {"ELASTIC_JOB_SECRET": secret})}[how]
    config, args = _parse_bare(tmp_path, monkeypatch, argv, env)
    js = JobSecret(secret)
    assert args.job_secret.password == js.password
    options = config.etcd_options
    assert open(options["etcd_ca"], "rb").read() == args.job_secret.ca_pem()
    assert options["etcd_user"] == "elastic" and open(options["etcd_password_file"]).read() == js.password
    assert secret not in repr(options) and js.root_password not in repr(options)  # workers never get root
    words, note = secret_source(args)
    if how == "env-secret":
        assert words == [] and "ELASTIC_JOB_SECRET" in note
    else:  # the join hint names the file to copy, and the command reads it
        assert words == ["--job-secret-file", path] and path in note and "0600" in note


@pytest.mark.parametrize("argv, words", [
    ([], []),                                   # nothing to say (a served etcd is refused later)
    (["--allow-insecure"], ["--allow-insecure"]),  # the joiner must accept the same
])
def test_the_join_hint_repeats_what_a_host_without_a_secret_needs(tmp_path, monkeypatch, argv, words):
    _, args = _parse_bare(tmp_path, monkeypatch, argv)
    assert secret_source(args) == (words, "")


def test_a_job_secret_file_others_can_read_is_refused_in_one_line(tmp_path, monkeypatch):
    path = _file(tmp_path, new_secret(), 0o644)
    with pytest.raises(ConfigError, match="can be read by other users .* chmod 600"):
        _parse_bare(tmp_path, monkeypatch, ["--job-secret-file", path])
