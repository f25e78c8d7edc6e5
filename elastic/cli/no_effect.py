"""Warnings for options given where they change nothing (``--checkpoint-every`` without
``--checkpoint-dir`` writes no checkpoint): the job still starts, but the user is told.

A table, read by a pure function (tests/unit/test_cli_no_effect.py runs it as a table).
"""

from __future__ import annotations

import argparse
from typing import Mapping

from .options import EnvValue

# (option given, the option it needs, what happens instead)
NO_EFFECT = (
    ("--checkpoint-every", "--checkpoint-dir", "no durable checkpoint is written"),
    ("--checkpoint-interval", "--checkpoint-dir", "no durable checkpoint is written"),
    ("--checkpoint-keep", "--checkpoint-dir", "no durable checkpoint is written"),
    ("--checkpoint-allow-fresh-start", "--checkpoint-dir", "there is no checkpoint to resume from"),
    ("--checkpoint-take-over", "--checkpoint-dir", "there is no checkpoint directory to take over"),
    ("--chaos-seed", "--chaos-kill-every", "no worker is killed"),
    ("--health-addr", "--health-port", "no /healthz or /metrics server is started"),
    ("--etcd-ca", "--rdzv-endpoint", "the embedded etcd takes no TLS"),
    ("--etcd-cert", "--rdzv-endpoint", "the embedded etcd takes no TLS"),
    ("--etcd-key", "--rdzv-endpoint", "the embedded etcd takes no TLS"),
    ("--etcd-user", "--rdzv-endpoint", "the embedded etcd takes no credentials"),
    ("--etcd-password", "--rdzv-endpoint", "the embedded etcd takes no credentials"),
)


def dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def given_as(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """{dest: how the user gave it} for every option not left at its default: the flag,
    or the environment variable it came from. Call before the values are coerced."""
    given = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in given:
            continue
        value = getattr(args, action.dest, None)
        if isinstance(value, EnvValue):
            given[action.dest] = value.variable
        elif value is not None and value is not False and value != action.default:
            given[action.dest] = action.option_strings[0]
    return given


def warnings(given: Mapping[str, str], values: Mapping[str, object]) -> list[str]:
    """One line per option in ``given`` (dest -> as typed) that has no effect with
    ``values`` (dest -> the final value, after Slurm and the defaults)."""
    lines = []
    for flag, needed, instead in NO_EFFECT:
        if dest(flag) in given and not values.get(dest(needed)):
            lines.append(f"{given[dest(flag)]} has no effect without {needed}: {instead}")
    return lines
