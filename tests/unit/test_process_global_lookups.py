"""The product code reaches the process's session (``elastic/worker/lifecycle.py``) from a
known, short list of places (architecture review 3: 34 such lookups, at most 8 asked).

A lookup is a call of ``lifecycle.current()`` or ``lifecycle.ring()`` (``_lifecycle()`` in
the package's ``__init__``), or of the Horovod layer's ``basics.session()``. Everything else
is handed its session or ring: the recovery loop takes the session once and passes the ring
down. A new lookup fails here until it is added to ``PLACES`` on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("elastic", "rendezvous", "checkpoint")

# file: lookups there, and why there.
PLACES = {
    "elastic/__init__.py": 1,  # the user API's elastic.rank() / world_size() / round()
    "elastic/worker/recovery.py": 1,  # elastic.run takes the session once per training function
    "elastic/state.py": 1,  # State._ring_now: commit(), save(), Horovod's sync() take no ring
    "elastic/sharded/state.py": 1,  # ShardedState._ring_now: the same for sharded states
    "elastic/sharded/mesh.py": 1,  # elastic.device_mesh(): the user builds a mesh per entry
    "elastic/horovod/basics.py": 1,  # hvd.rank() and the rest of Horovod's module functions
    "elastic/horovod/elastic/sampler.py": 1,  # Horovod partitions at construction
    "elastic/horovod/optimizer.py": 1,  # the optimizer's hooks tell rounds apart
}
MOST = 8


def _is_lookup(call: ast.Call) -> bool:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return False
    owner = func.value
    if func.attr in ("current", "ring"):
        return (isinstance(owner, ast.Name) and owner.id == "lifecycle") or (
            isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "_lifecycle")
    return func.attr == "session" and isinstance(owner, ast.Name) and owner.id == "basics"


def lookups() -> dict[str, list[int]]:
    """{file: lines of its lookups} over the product code."""
    found: dict[str, list[int]] = {}
    for folder in PRODUCT:
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative == "elastic/worker/lifecycle.py":
                continue  # where the session lives
            for node in ast.walk(ast.parse(path.read_text(), relative)):
                if isinstance(node, ast.Call) and _is_lookup(node):
                    found.setdefault(relative, []).append(node.lineno)
    return found


def test_the_session_is_looked_up_only_in_the_listed_places():
    found = lookups()
    assert {f: len(lines) for f, lines in found.items()} == PLACES, found
    assert sum(PLACES.values()) <= MOST


def test_the_count_sees_each_form_of_lookup():
    source = ("lifecycle.current()\nlifecycle.ring().commit(x)\n_lifecycle().current()\nbasics.session().round\n"
              "lifecycle.install(s)\nother.ring()\n")
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    assert sum(_is_lookup(c) for c in calls) == 4
