"""The options several ``elastic-run`` commands share, and how any option is read.

Every option has an environment form (``--min-np`` <- ``ELASTIC_MIN_NP``), so a
Kubernetes manifest can configure the agent with ``env:`` alone. Bad input is one
line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import math
import os

from elastic.rendezvous import ConfigError, EtcdConfig

from . import etcd_secrets

# The commands import it from here; its value is the contract's (exit_codes.py).
from ..contract.exit_codes import USAGE_ERROR  # noqa: F401


class OptionParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise ConfigError(message)


def env_name(name: str) -> str:
    """The environment form of option ``name`` ("min-np" -> ELASTIC_MIN_NP)."""
    return "ELASTIC_" + name.lstrip("-").upper().replace("-", "_")


def env_value(name: str, default=None):
    return os.environ.get(env_name(name), default)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):  # inf overflows timedelta, leases and timeouts (review 11)
        raise ValueError
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:  # nan would never settle a round
        raise ValueError
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError
    return value


RDZV_BACKENDS = ("etcd", "c10d")


def rdzv_backend(text: str) -> str:
    """``--rdzv-backend``: etcd (an etcd v3 answers at the endpoint) or c10d (its host serves one)."""
    if text not in RDZV_BACKENDS:
        raise ValueError
    return text


def exit_code(text: str) -> int:
    """A process exit status a parent can read: 0..255."""
    value = int(text)
    if not 0 <= value <= 255:
        raise ValueError
    return value


def hang_timeout(text: str) -> float:
    """Seconds (0 or "off" disables); below 1 s a heartbeat gap would already count."""
    value = 0.0 if text.strip().lower() == "off" else float(text)
    if value != 0 and not 1 <= value < math.inf:
        raise ValueError
    return value


def ratio_above_one(text: str) -> float:
    value = float(text)
    if not 1 < value < math.inf:  # at or below 1, half of any ring would be "slower than the median"
        raise ValueError
    return value


def on_off(text: str) -> bool:
    """An on/off option's environment form."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


positive_int.__name__ = "positive integer"
ratio_above_one.__name__ = "number above 1"
on_off.__name__ = "1/true/yes/on or 0/false/no/off"
hang_timeout.__name__ = "number of seconds >= 1, or 0/off"
non_negative_int.__name__ = "non-negative integer"
positive_float.__name__ = "positive number"
non_negative_float.__name__ = "number >= 0"
port.__name__ = "port number (0-65535)"


# --help's placeholder by the kind of value (--nproc-per-node N, not NODE); else the flag's last word.
_METAVARS = {positive_int: "N", non_negative_int: "N", positive_float: "SECONDS", float: "SECONDS",
             hang_timeout: "SECONDS", ratio_above_one: "RATIO", exit_code: "STATUS"}


def add_option(p: argparse.ArgumentParser, flag: str, kind=str, default=None, help: str = "") -> None:
    """An option with its environment form (``--min-np`` <- ``ELASTIC_MIN_NP``)."""
    name = flag.lstrip("-")
    env = env_name(name)
    from_env = env_value(name)
    # Wrapped, so argparse leaves it alone and the check below names the variable.
    value = EnvValue(env, from_env) if from_env is not None else default
    p.add_argument(flag, type=kind, default=value, metavar=_METAVARS.get(kind, name.split("-")[-1].upper()),
                   help=f"{help} [env {env}]" + (f" (default {default})" if default is not None else ""))


def add_switch(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """An on/off option (``--evict-stragglers``) with its environment form (``=1``)."""
    env = env_name(flag)
    from_env = env_value(flag)
    p.add_argument(flag, action="store_const", const=True, default=EnvValue(env, from_env)
                   if from_env is not None else False, help=f"{help} [env {env}=1]")


# Where the job lives and how to reach etcd: shared by the launcher and `elastic-run status`.
JOB_OPTIONS = (
    ("--rdzv-endpoint", "etcd v3 endpoints HOST:PORT[,HOST:PORT...]; none: start an embedded etcd"),
    ("--job-id", "the job's name; required with --rdzv-endpoint"),
)
ETCD_OPTIONS = (
    ("--etcd-ca", "CA certificate (PEM) for TLS to etcd"),
    ("--etcd-cert", "client certificate (PEM)"),
    ("--etcd-key", "client key (PEM)"),
    ("--etcd-user", "etcd user name"),
    ("--etcd-password", "etcd password (visible in ps: prefer --etcd-password-file)"),
    ("--etcd-password-file", "file holding the etcd password (mode 0600); workers get its path, never the password"),
    ("--job-secret-file", "file (mode 0600) holding the job's secret, the same on every host: the etcd the job "
                          "serves itself (bare metal, Slurm) runs with TLS and auth from it (SECURITY.md)"),
)


def add_allow_insecure(p: argparse.ArgumentParser) -> None:
    add_switch(p, "--allow-insecure", "accept an etcd password without TLS (--etcd-ca), an https:// endpoint "
               "without a CA, or serving the job's etcd off loopback without --job-secret-file; refused otherwise")


def etcd_config(args: argparse.Namespace) -> EtcdConfig:
    """The EtcdConfig the options describe (endpoint, TLS files, credentials)."""
    etcd_secrets.resolve_password(args)
    return EtcdConfig.from_string(
        args.rdzv_endpoint,
        ca_cert=args.etcd_ca, cert_cert=args.etcd_cert, cert_key=args.etcd_key,
        user=args.etcd_user, password=args.etcd_password,
        require_auth=bool(args.etcd_user) and not getattr(args, "allow_insecure", False),
        # Only the launcher has this option (`elastic-run status` keeps the default).
        retry_deadline=getattr(args, "etcd_retry_deadline", None),
    )


class EnvValue:
    """An option's value taken from its environment variable, not yet checked."""

    def __init__(self, variable: str, text: str):
        self.variable, self.text = variable, text


def coerce_env_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Values that came from the environment arrive as strings: convert and check them,
    naming the variable (not the option) when one is bad."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not isinstance(value, EnvValue):
            continue
        kind = on_off if action.const is True else action.type
        if kind in (None, str):
            setattr(args, action.dest, value.text)
            continue
        try:
            setattr(args, action.dest, kind(value.text))
        except (TypeError, ValueError):
            raise ConfigError(f"{value.variable}={value.text!r}: expected {_article(kind.__name__)}") from None


def _article(kind: str) -> str:
    return kind if kind[0].isdigit() else f"a {kind}"


# `elastic-run --help` in groups, by flag: a new option joins a group with one line here
# (tests/unit/test_cli_help.py fails while one is left outside them).
OPTION_GROUPS = (
    ("job shape", "how many workers, and where they run", (
        "--np", "--min-np", "--max-np", "--nproc-per-node", "--backend", "--cold-starts", "-m")),
    ("rendezvous", "where the job's membership lives (etcd v3) and how this host is reached", (
        "--rdzv-endpoint", "--rdzv-backend", "--job-id", "--host-id", "--host-addr", "--rdzv-ttl", "--rdzv-timeout",
        "--rdzv-settle", "--etcd-retry-deadline")),
    ("failures", "what a lost, hung, slow or stopped worker costs (docs/failures.md)", (
        "--collective-timeout", "--hang-timeout", "--max-resets", "--reset-window", "--max-restarts",
        "--grace-period", "--leave-exit-code", "--straggler-ratio", "--evict-stragglers")),
    ("checkpoints", "durable checkpoints on disk (commits are in memory and always on)", (
        "--checkpoint-dir", "--checkpoint-every", "--checkpoint-interval", "--checkpoint-keep",
        "--checkpoint-allow-fresh-start", "--checkpoint-take-over", "--final-checkpoint-timeout",
        "--shard-replicas")),
    ("observability", "logs, events, /metrics, and chaos tests (docs/observability.md)", (
        "--log-dir", "--log-max-bytes", "--console-ranks", "--health-port", "--health-addr", "--chaos-kill-every",
        "--chaos-seed")),
    ("security", "TLS and credentials for an external etcd (SECURITY.md)", (
        "--etcd-ca", "--etcd-cert", "--etcd-key", "--etcd-user", "--etcd-password", "--etcd-password-file",
        "--job-secret-file", "--allow-insecure")),
    ("compatibility", "torchrun's spellings (--nnodes, --rdzv-id, --nproc_per_node gpu, --standalone ...)\n"
                      "and horovodrun's (-np, --reset-limit, -H localhost:N ...) are translated, or refused\n"
                      "with what to use instead (docs/torchrun.md)", (
        "--horovod-shim", "--version")),
)


def group_options(parser: argparse.ArgumentParser) -> None:
    """Move the parser's options into OPTION_GROUPS' argument groups, for --help."""
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    placed = set()
    for title, description, flags in OPTION_GROUPS:
        group = parser.add_argument_group(title, description)
        for flag in flags:
            action = by_flag.get(flag)
            if action is None or id(action) in placed:
                continue
            placed.add(id(action))
            parser._optionals._group_actions.remove(action)
            group._group_actions.append(action)
    parser._optionals.title = "options"
