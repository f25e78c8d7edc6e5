"""The generated pages of the docs site: the CLI reference from the real argparse
parsers, the API reference from the public API's docstrings, and the repository's
top-level Markdown files (README, ARCHITECTURE, BENCHMARKS, SECURITY, deploy/) as
site pages with their links pointed at the site.

Used by docs/gen/hooks.py at `make docs` time and by tests/unit/test_docs.py, which
fails when an option of the parser is missing from the CLI reference.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import posixpath
import re
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Repository file -> the site page it becomes (paths relative to docs/).
INCLUDED = {
    "README.md": "index.md",
    "ARCHITECTURE.md": "architecture.md",
    "BENCHMARKS.md": "benchmarks.md",
    "SECURITY.md": "security.md",
    "deploy/README.md": "deploy/kubernetes-manifests.md",
    "deploy/slurm/README.md": "deploy/slurm-sbatch.md",
}

# --- the CLI reference -----------------------------------------------------------------


def _option_rows(actions) -> list[str]:
    rows = ["| option | value | default | environment | what it does |", "|---|---|---|---|---|"]
    for action in actions:
        if not action.option_strings:
            continue
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
        takes_value = action.nargs != 0
        value = f"`{action.metavar}`" if takes_value and action.metavar else ""
        default = action.default
        # A default taken from an ELASTIC_* variable of the machine building the docs is not shown.
        # (`is`, not `in`: 0 == False, and a default of 0 is shown as 0.)
        unset = default is None or default is False or default is argparse.SUPPRESS \
            or type(default).__name__ == "EnvValue"
        shown = "" if unset or not takes_value else f"`{default}`"
        text = action.help or ""
        env = ""
        # add_option's suffix: " [env ELASTIC_X]" and its " (default D)", shown in their own columns.
        found = re.search(r" \[env (ELASTIC_[A-Z_]+(?:=1)?)\](?: \(default [^)]*\))?$", text)
        if found:
            env = f"`{found.group(1)}`"
            text = text[:found.start()]
        text = text.replace("|", "\\|")
        rows.append(f"| {flags} | {value} | {shown} | {env} | {text} |")
    return rows


def _help_text(main, argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    return out.getvalue().rstrip()


def cli_reference() -> str:
    from elastic.cli import launch, status

    parser = launch.build_parser()
    lines = [
        "# Command-line reference",
        "",
        "Generated from the parsers themselves at `make docs` time (`docs/gen/reference.py`);",
        "`tests/unit/test_docs.py` fails when an option of `elastic-run` is missing here.",
        "Every option also has an environment form: `--min-np` is `ELASTIC_MIN_NP`, a switch",
        "such as `--evict-stragglers` is `ELASTIC_EVICT_STRAGGLERS=1`. An option given where it",
        "changes nothing (`--checkpoint-every` without `--checkpoint-dir`) is warned about.",
        "",
        "## elastic-run [options] SCRIPT [args]",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        *[paragraph.replace("\n", " ") + "\n" for paragraph in textwrap.dedent(parser.description or "").strip().split("\n\n")],
    ]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings]
        if not actions:
            continue
        lines += [f"### {group.title}", ""]
        if group.description:
            lines += [group.description.replace("\n", " "), ""]
        lines += [*_option_rows(actions), ""]
    lines += ["## elastic-run status", "", *_option_rows(status.build_parser()._actions), ""]
    from elastic.cli.timeline import main as timeline
    from elastic.checkpoint.cli import main as checkpoints

    for name, main in (("timeline", timeline), ("checkpoints", checkpoints)):
        lines += [f"## elastic-run {name}", "", "```text", _help_text(main, ["--help"]), "```", ""]
    return "\n".join(lines)


def launcher_flags() -> set[str]:
    from elastic.cli import launch

    return {flag for action in launch.build_parser()._actions for flag in action.option_strings}


# --- the API reference -----------------------------------------------------------------

# (heading, dotted name, members to document)
API = (
    ("Starting and the training function", "elastic", ()),
    ("", "elastic.init", ()),
    ("", "elastic.run", ()),
    ("", "elastic.rank", ()), ("", "elastic.size", ()), ("", "elastic.local_rank", ()),
    ("", "elastic.round", ()), ("", "elastic.shutdown", ()),
    ("", "elastic.report", ()),
    ("State", "elastic.State", ("commit", "sync", "register_reset_callbacks")),
    ("", "elastic.TorchState", ()),
    ("", "elastic.ObjectState", ()),
    ("Data", "elastic.ElasticSampler", ("set_epoch", "record_batch", "record_indices", "batches",
                                        "loss_scale", "state_dict", "load_state_dict")),
    ("", "elastic.accumulate", ()),
    ("", "elastic.ShardedSource", ("tokens", "json_lines", "parquet", "custom", "collate")),
    ("", "elastic.SourceSampler", ("set_epoch", "record_batch", "loss_scale", "state_dict", "load_state_dict")),
    ("", "elastic.StatefulStream", ()),
    ("Sharded models (FSDP2)", "elastic.ShardedState", ()),
    ("", "elastic.device_mesh", ()),
    ("Errors", "elastic.HostsUpdatedInterrupt", ()),
    ("", "elastic.ResetLimitExceeded", ()),
    ("", "elastic.ElasticError", ()),
    ("Horovod's API", "elastic.horovod", ()),
    ("", "elastic.horovod.elastic", ()),
)


# Modules whose docstring goes on with internals after its usage: the first N paragraphs.
MODULE_PARAGRAPHS = {"elastic": 3}


def _resolve(dotted: str):
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _markdown(doc: str) -> str:
    """A docstring as Markdown: ``x`` -> `x`; reST section underlines -> bold lines."""
    doc = inspect.cleandoc(doc or "(no docstring)")
    doc = re.sub(r"``([^`]+)``", r"`\1`", doc)
    out, lines = [], doc.split("\n")
    for i, line in enumerate(lines):
        if re.fullmatch(r"[-=~]{3,}", line.strip()) and out and out[-1].strip():
            out[-1] = f"**{out[-1].strip()}**"
            continue
        out.append(line)
    return "\n".join(out)


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj)).replace("'", "")  # annotations are strings here
    except (TypeError, ValueError):
        return ""


def api_reference() -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings of the public API at `make docs` time "
             "(`docs/gen/reference.py`). The guide is [Writing an elastic script](guide.md).", ""]
    for heading, dotted, members in API:
        if heading:
            lines += [f"## {heading}", ""]
        obj = _resolve(dotted)
        if inspect.ismodule(obj):
            doc = _markdown(obj.__doc__)
            if dotted in MODULE_PARAGRAPHS:  # the usage, not the package's internal layout
                doc = "\n\n".join(doc.split("\n\n")[:MODULE_PARAGRAPHS[dotted]])
            lines += [f"### `{dotted}`", "", doc, ""]
            continue
        kind = "class" if inspect.isclass(obj) else "def"
        # The name as the heading (it is the page's table of contents), the signature below it.
        lines += [f"### `{dotted}`", "", "```python", f"{kind} {dotted}{_signature(obj)}", "```", "",
                  _markdown(obj.__doc__), ""]
        for name in members:
            member = inspect.getattr_static(obj, name)
            if isinstance(member, property):
                lines += [f"#### `{name}` (property)", "", _markdown(member.fget.__doc__), ""]
            else:
                signature = _signature(getattr(obj, name)).replace("(self, ", "(").replace("(self)", "()")
                lines += [f"#### `{name}`", "", "```python", f"def {name}{signature}", "```", "",
                          _markdown(member.__doc__), ""]
    return "\n".join(lines)


# --- the repository's Markdown files as pages, and links as GitHub and the site resolve them --

_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
# A figure's one source (BENCHMARKS.md) and a page's quote of it: `<!-- figure:NAME -->VALUE<!-- /figure -->`,
# `<!-- quote:NAME -->VALUE<!-- /quote -->`. The build replaces every quote's value with the figure's;
# tests/unit/test_docs.py fails while a page's quote differs from its figure (GitHub shows the page as is).
_FIGURE = re.compile(r"<!-- figure:([\w-]+) -->(.*?)<!-- /figure -->")
_QUOTE = re.compile(r"<!-- quote:([\w-]+) -->(.*?)<!-- /quote -->")
# Pages the site generates that a docs page may link to: on GitHub the link lands on a stub
# (docs/cli.md, docs/api.md) saying so; in the site the generated page replaces it.
GENERATED = ("cli.md", "api.md")


def figures() -> dict[str, str]:
    """BENCHMARKS.md's figures, by name."""
    return dict(_FIGURE.findall((REPO / "BENCHMARKS.md").read_text()))


def quotes(text: str) -> list[tuple[str, str]]:
    """(figure name, value as quoted) of every quote in ``text``."""
    return _QUOTE.findall(text)


def quote_figures(text: str, known: dict[str, str]) -> str:
    """``text`` with every quote's value replaced by its figure's (KeyError: an unknown figure)."""
    return _QUOTE.sub(lambda m: f"<!-- quote:{m.group(1)} -->{known[m.group(1)]}<!-- /quote -->", text)


def relink(text: str, repo_path: str, page: str) -> str:
    """``text`` (the file ``repo_path``, the site's page ``page``) with its relative links
    aimed at the site: a page of the site (an included file, or one under docs/) stays a
    link; any other file of the repository becomes its path in code, since the site does
    not serve it. Links are written as GitHub resolves them (paths that exist)."""
    here = posixpath.dirname(repo_path)

    def one(match: re.Match) -> str:
        bang, label, target = match.groups()
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            return match.group(0)
        path, _, anchor = target.partition("#")
        full = posixpath.normpath(posixpath.join(here, path))
        site = INCLUDED.get(full) or (full[len("docs/"):] if full.startswith("docs/") else None)
        if site is None:
            return f"{label} (`{full}`)" if label and label != f"`{full}`" else f"`{full}`"
        rel = posixpath.relpath(site, posixpath.dirname(page) or ".")
        return f"{bang}[{label}]({rel}{'#' + anchor if anchor else ''})"

    return _LINK.sub(one, text)


def included_page(repo_path: str) -> str:
    """A repository file (README, ARCHITECTURE, ...) as its site page."""
    return quote_figures(relink((REPO / repo_path).read_text(), repo_path, INCLUDED[repo_path]), figures())


def docs_page(markdown: str, src_uri: str) -> str:
    """A page under docs/ as the site shows it (mkdocs' on_page_markdown)."""
    return quote_figures(relink(markdown, f"docs/{src_uri}", src_uri), figures())


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces
    to hyphens (not collapsed)."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub makes them (repeats get -1, -2...)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading and not in_code:
            slug = github_slug(heading.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out
