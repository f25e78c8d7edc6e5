"""ARCHITECTURE.md names only what exists: every module path it cites (and the guides cite)
is a file of the repository, and every code name it cites is defined in the code.

The names are read with ``ast`` from the product code (``elastic/``, ``rendezvous/``,
``checkpoint/``): modules, classes, functions, methods, assigned names and attributes,
keyword names, and identifier-like strings (event names, keys). ``X.y`` must be a member
of the class or module ``X`` where ``X`` is one. A name of another system that the text
cites on purpose is in ``OTHER_SYSTEMS``, with where it comes from.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("elastic", "rendezvous", "checkpoint")
OUR_FOLDERS = PRODUCT + ("tests", "benchmarks", "deploy", "docs", "examples")

# Cited in ARCHITECTURE.md, defined elsewhere.
OTHER_SYSTEMS = {
    "Complete": "a Kubernetes Job's condition",
    "parallelism": "a Kubernetes Job's field",
    "completions": "a Kubernetes Job's field",
    "ast": "Python's standard library",
}

_IDENTIFIER = re.compile(r"^@?([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(\(\))?$")
_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@lru_cache(maxsize=1)
def code_names() -> tuple[frozenset, dict]:
    """(every name defined or named in the product code, {module or class: its members})."""
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for folder in PRODUCT:
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            module = path.parent.name if path.stem == "__init__" else path.stem
            names.add(module)
            scope = members.setdefault(module, set())
            if path.stem != "__init__":
                members.setdefault(path.parent.name, set()).add(module)
            for node in tree.body:
                scope.update(_bound(node))
            for node in ast.walk(tree):
                names.update(_bound(node))
                if isinstance(node, ast.ClassDef):
                    members.setdefault(node.name, set()).update(n for sub in ast.walk(node) for n in _bound(sub))
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.keyword) and node.arg:
                    names.add(node.arg)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _WORD.match(node.value):
                    names.add(node.value)
    members["elastic"].update({"rendezvous", "checkpoint"})  # installed under elastic (pyproject.toml)
    return frozenset(names), members


def _bound(node: ast.AST) -> set[str]:
    """The names a statement binds in its own scope."""
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        found = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        return found | {n.attr for t in targets for n in ast.walk(t) if isinstance(n, ast.Attribute)}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return set()


def cited(text: str) -> list[str]:
    """The inline code spans of ``text`` (fenced blocks are the docs test's: test_docs.py)."""
    return re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def missing_paths(text: str) -> list[str]:
    found = []
    for span in cited(text):
        path = span.split()[0].split(":")[0] if span.strip() else ""
        if not path or path.startswith("/") or "<" in path or "*" in path:
            continue  # an etcd key, a placeholder, a pattern
        if "/" in path and path.split("/")[0] in OUR_FOLDERS:
            if not (REPO / path).exists():
                found.append(span)
        elif "/" not in path and re.fullmatch(r"[\w.-]+\.(py|md|toml|yaml|yml|sh)", path):
            if not any(p for p in REPO.rglob(path) if ".venv" not in p.parts):
                found.append(span)
    return found


def missing_names(text: str) -> list[str]:
    names, members = code_names()
    found = []
    for span in cited(text):
        match = _IDENTIFIER.match(span)
        if match is None or span in OTHER_SYSTEMS or re.fullmatch(r"[\w-]+\.(py|md|toml|yaml|yml|sh|json)", span):
            continue
        parts = match.group(1).split(".")
        if any(part not in names for part in parts):
            found.append(span)
            continue
        owner, name = (parts[-2], parts[-1]) if len(parts) > 1 else (None, None)
        # Class.member and module.name are checked where they belong; a variable's method
        # (`state.commit()`) only as a name.
        strict = owner is not None and owner in members and (owner[0].isupper() or not match.group(2))
        if strict and name not in members[owner]:
            found.append(span)
    return found


def test_architecture_cites_only_paths_and_names_that_exist():
    text = (REPO / "ARCHITECTURE.md").read_text()
    assert missing_paths(text) == []
    assert missing_names(text) == []


@pytest.mark.parametrize("path", sorted((REPO / "docs").glob("*.md")), ids=lambda p: p.name)
def test_the_guides_cite_only_paths_that_exist(path):
    assert missing_paths(path.read_text()) == []


def test_the_checks_catch_a_stale_name_and_a_moved_module():
    text = ("`rounds.decide` in `rendezvous/rounds.py`; `note_commit` in `elastic/worker/ring.py`; "
            "`Runtime.no_such_method`, `elastic/worker/gone.py`, `rendezvous/keys.py:12`, `Agent._carry_out`")
    assert missing_names(text) == ["note_commit", "Runtime.no_such_method"]
    assert missing_paths(text) == ["elastic/worker/gone.py"]
