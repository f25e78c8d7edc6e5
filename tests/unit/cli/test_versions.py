"""Supported versions: one table (elastic/cli/versions.py, quoted by docs/versions.md), and a
warning line at start under a torch the suite never ran with."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.cli import launch, versions

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("installed, warns", [
    ("2.13.0", False), ("2.13.0+cpu", False), ("2.13.1+cu128", False),
    ("2.5.1", True), ("2.14.0.dev20261101", True), ("3.0.0", True), (None, False),
])
def test_an_untested_torch_is_warned_about(installed, warns):
    line = versions.torch_warning(lambda: installed)
    assert (line is not None) == warns
    if warns:
        assert line.startswith(f"torch {installed} is installed, and elastic-run is tested with torch 2.13 only")


def test_the_launcher_warns_at_start_under_an_untested_torch_and_not_under_this_one(tmp_path, caplog, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    argv = ["--np", "1", "--rdzv-endpoint", "127.0.0.1:1", "--job-id", "j", str(script)]

    def warnings() -> list[str]:
        found = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "tested with torch" in
                 r.getMessage()]
        caplog.clear()
        return found

    assert launch.main(argv) == 1  # nothing listens at port 1: it fails after its start-up lines
    assert warnings() == []  # this environment's torch is a tested one
    monkeypatch.setattr(versions, "_installed_torch", lambda: "2.5.1")
    assert launch.main(argv) == 1
    assert [line[:60] for line in warnings()] == ["torch 2.5.1 is installed, and elastic-run is tested with tor"]


def test_the_docs_table_is_the_codes():
    assert versions.markdown_table() in (REPO / "docs" / "versions.md").read_text()
