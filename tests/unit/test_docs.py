"""The docs cannot drift from the code: the README stays a landing page, the CLI
reference has every option, the site's nav names pages that exist, and every code block
of the guides compiles (Python, YAML, the added side of a diff) or parses with the real
parser (each `elastic-run ...` line of a shell block)."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from elastic.cli import horovodrun, launch, status, torchrun

REPO = Path(__file__).resolve().parents[2]


def _reference():
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "docs" / "gen" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def guide_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "deploy" / "README.md",
             REPO / "deploy" / "slurm" / "README.md"]
    files += sorted(p for p in (REPO / "docs").rglob("*.md") if "gen" not in p.relative_to(REPO / "docs").parts)
    return files


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, and of every indented block ("")."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+)\s*([\w+-]*)", lines[i])
        if fence:
            indent, marks, language = fence.groups()
            body, i = [], i + 1
            while i < len(lines) and not lines[i].strip().startswith(marks):
                body.append(lines[i][len(indent):])
                i += 1
            blocks.append((language or "", "\n".join(body)))
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()) and lines[i].strip():
            body = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            blocks.append(("", "\n".join(body).strip("\n")))
            continue
        i += 1
    return blocks


def command_lines(code: str) -> list[list[str]]:
    """The `elastic-run ...` commands of a shell block, continuation lines joined."""
    commands = []
    for line in code.replace("\\\n", " ").split("\n"):
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value elastic-run ...
            words = words[1:]
        if words[:1] == ["elastic-run"] and len(words) > 1:
            commands.append(words[1:])
    return commands


def parse_command(argv: list[str]) -> None:
    """What `elastic-run ARGV` does with its arguments, without starting anything."""
    if argv[0] == "status":
        status.build_parser().parse_args(argv[1:])
        return
    if argv[0] in ("timeline", "checkpoints"):
        assert len(argv) > 1, f"elastic-run {argv[0]} needs a directory"
        return
    parser = launch.build_parser()
    argv = torchrun.accept(argv, parser)
    argv = horovodrun.translate(argv, horovodrun.value_flags_of(parser)).argv
    options, script = launch._split_at_script(parser, argv)
    assert script, f"no SCRIPT in {argv}"
    parser.parse_args([*options, "--", script[0]])


def _cases():
    for path in guide_files():
        for n, (language, code) in enumerate(code_blocks(path.read_text())):
            yield pytest.param(language, code, id=f"{path.relative_to(REPO)}#{n}")


@pytest.mark.parametrize("language, code", list(_cases()))
def test_every_code_block_compiles_or_parses(language, code):
    if language == "python":
        compile(code, "<docs>", "exec")
    elif language == "diff":  # the script after the change
        after = [line[1:] for line in code.split("\n") if not line.startswith("-")]
        compile("\n".join(after), "<docs diff>", "exec")
    elif language == "yaml":
        yaml = pytest.importorskip("yaml")
        list(yaml.safe_load_all(code))
    elif language in ("", "sh", "bash", "shell", "console", "text"):
        for argv in command_lines(code):
            parse_command(argv)


def test_the_checks_catch_a_broken_block():
    with pytest.raises(SyntaxError):
        compile("for ...:\n    pass", "<docs>", "exec")
    with pytest.raises(Exception):
        for argv in command_lines("elastic-run --np 2 --no-such-option train.py"):
            parse_command(argv)
    assert command_lines("$ ELASTIC_X=1 elastic-run --np 2 \\\n    t.py  # c") == [["--np", "2", "t.py"]]


def test_readme_is_a_landing_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024
    for heading in ("## Get started", "## Run your torchrun script as it is", "## Make it elastic"):
        assert heading in readme
    assert "make demo" in readme and "make test" in readme and "docs/timeline.png" in readme


@pytest.mark.parametrize("path", [p for p in guide_files() + [REPO / "BENCHMARKS.md", REPO / "SECURITY.md"]],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve_as_github_renders_them(path):
    """A relative link is a file of the repository, as GitHub resolves it (the site's build
    points it at the site: docs/gen/reference.py's relink), and its anchor is one of that
    file's headings as GitHub makes anchors. `make docs` checks the same in the site."""
    reference = _reference()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        full = (path.parent / file).resolve() if file else path
        if not full.exists():
            broken.append(f"{target}: no such file")
        elif anchor and full.suffix == ".md" and anchor not in reference.anchors(full):
            broken.append(f"{target}: no heading with that anchor in {full.relative_to(REPO)}")
    assert broken == [], f"{path.relative_to(REPO)}: {broken}"


def test_github_anchors_are_githubs():
    slug = _reference().github_slug
    assert slug("The job's secret: TLS and authentication by default") == "the-jobs-secret-tls-and-authentication-by-default"
    assert slug("`--max-restarts` and `--max-resets`") == "--max-restarts-and---max-resets"
    assert slug("Scale, preempt, stop") == "scale-preempt-stop"


def test_every_quoted_figure_is_benchmarks():
    """One source per figure: BENCHMARKS.md; a page quotes it, and the build replaces the
    quote's value with the figure's, so a page read on GitHub must not differ either."""
    reference = _reference()
    known = reference.figures()
    assert {"sigkill-recovery", "torchrun-sigkill"} <= set(known)
    wrong = [(path.name, name, value) for path in guide_files() for name, value in reference.quotes(path.read_text())
             if known.get(name) != value]
    assert wrong == [], f"quotes that are not BENCHMARKS.md's figure: {wrong} (figures: {known})"
    assert reference.quote_figures("a <!-- quote:sigkill-recovery -->9 s<!-- /quote --> b", known) == \
        f"a <!-- quote:sigkill-recovery -->{known['sigkill-recovery']}<!-- /quote --> b"


# Prose that sends the reader to a section of the README: (README, "Title"), the README's "Title".
_CITED = re.compile(r"README(?:'s|,)\s+\"([^\"]+)\"")


def test_cited_readme_sections_exist():
    """Prose cannot be a link the site checks: the README (the root's; in another README, that
    README itself) must have each section a page cites by its title."""
    def headings(path: Path) -> set[str]:
        return {h.strip() for h in re.findall(r"^#{1,4}\s+(.*)$", path.read_text(), re.M)}

    missing = []
    for path in guide_files():
        readme = path if path.name == "README.md" else REPO / "README.md"
        for title in _CITED.findall(path.read_text()):
            title = " ".join(title.split())
            if title not in headings(readme) and not any(h.startswith(title) for h in headings(readme)):
                missing.append((str(path.relative_to(REPO)), title))
    assert missing == []
    assert _CITED.findall('(README, "A constant global batch") and the README\'s "Coming from Horovod"') == [
        "A constant global batch", "Coming from Horovod"]


def test_cli_reference_names_every_option_in_its_group():
    reference = _reference()
    text = reference.cli_reference()
    missing = [flag for flag in sorted(reference.launcher_flags()) if f"`{flag}`" not in text]
    assert missing == []
    for title in ("job shape", "rendezvous", "failures", "checkpoints", "observability", "security",
                  "compatibility"):
        assert f"### {title}" in text
    status_flags = {f for a in status.build_parser()._actions for f in a.option_strings}
    assert all(f"`{flag}`" in text for flag in status_flags)


def test_nav_pages_exist():
    reference = _reference()
    generated = {"cli.md", "api.md", *reference.INCLUDED.values()}
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    assert "porting/from-torchrun-ddp.md" in nav and "faq.md" in nav
    for page in nav:
        assert page in generated or (REPO / "docs" / page).exists(), page
    for repo_path in reference.INCLUDED:
        assert (REPO / repo_path).exists()


def test_the_cli_reference_shows_a_default_of_0_as_0():
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in _reference().cli_reference().splitlines()
            if line.startswith("| `--")}
    assert rows["`--max-restarts`"][2] == "`0`"
    assert rows["`--leave-exit-code`"][2] == "`0`"
    assert rows["`--max-resets`"][2] == "`20`"
    assert rows["`--checkpoint-dir`"][2] == ""  # no default: blank
