"""`elastic-run --help` in groups with every option, --version, and errors that name
options as the user typed them (newcomer review, section 4)."""

from __future__ import annotations

import contextlib
import io

import pytest

from elastic.cli import launch as cli
from elastic.cli.options import OPTION_GROUPS
from elastic.rendezvous import ConfigError


def ungrouped_options(parser) -> list[str]:
    """Options --help shows under plain "options" (none but -h once every one has a group)."""
    return [action.option_strings[0] for action in parser._optionals._group_actions
            if action.option_strings and action.option_strings[0] != "-h"]


def _help() -> str:
    return cli.build_parser().format_help()


def test_every_option_sits_in_a_named_group():
    assert ungrouped_options(cli.build_parser()) == []
    titles = [title for title, _, _ in OPTION_GROUPS]
    assert titles == ["job shape", "rendezvous", "failures", "checkpoints", "observability", "security",
                      "compatibility"]
    text = _help()
    assert all(f"\n{title}:\n" in text for title in titles)


def test_help_lists_every_accepted_option_the_shim_and_version_included():
    text = _help()
    flags = {flag for action in cli.build_parser()._actions for flag in action.option_strings}
    assert {"--horovod-shim", "--version", "--checkpoint-every"} <= flags
    assert [flag for flag in flags if flag not in text] == []


def test_placeholders_say_what_a_value_is():
    text = _help()
    assert "--nproc-per-node N " in text and "--checkpoint-every N " in text
    assert "--chaos-kill-every SECONDS" in text and " NODE" not in text and " EVERY" not in text


def test_version_prints_the_installed_version_and_exits_0():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        cli.parse(["--version"])
    assert stop.value.code == 0 and out.getvalue().startswith("elastic-run ")


@pytest.mark.parametrize("argv, env, message", [
    (["--np", "4", "--min-np", "5"], {}, "--min-np 5 is above --np 4"),
    (["--min-np", "5", "--max-np", "4"], {}, "--min-np 5 is above --max-np 4"),
    (["--np", "8", "--max-np", "4"], {}, "--np 8 is above --max-np 4"),
    (["--np", "2"], {"ELASTIC_MIN_NP": "3"}, "ELASTIC_MIN_NP 3 is above --np 2"),
    (["--np", "2", "--rdzv-settle", "-1"], {}, "argument --rdzv-settle: invalid number >= 0 value: '-1'"),
    ([], {}, "no SCRIPT"),
])
def test_errors_name_the_options_as_typed(tmp_path, monkeypatch, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ConfigError) as error:
        cli.parse([*argv, "--backend", "gloo", *([str(script)] if argv else [])])
    assert message in str(error.value)
    assert "max_np" not in str(error.value) and "min_np" not in str(error.value)
