"""The data page's examples run: each Python block that starts with ``# Runnable:`` is a whole
script, run as written in a world of one (one subprocess for all: one import of torch)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PAGE = REPO / "docs" / "data-and-setup-code.md"

RUNNER = r"""
import sys, runpy, elastic
for path in sys.argv[1:]:
    runpy.run_path(path, run_name="__main__")
    elastic.shutdown()              # the next example starts its own world of one
    print("ran", path, flush=True)
"""


def runnable_examples() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    return [block for block in blocks if block.startswith("# Runnable:")]


def test_the_page_has_an_example_of_each_kind():
    names = [block.split("\n", 1)[0] for block in runnable_examples()]
    assert len(names) == 3, names
    kinds = "\n".join(runnable_examples())
    for kind in ("elastic.ElasticSampler(", "elastic.ShardedSource.tokens(", "elastic.StatefulStream("):
        assert kind in kinds


def test_the_examples_run(tmp_path):
    pytest.importorskip("datasets")
    pytest.importorskip("torchdata")
    paths = []
    for n, block in enumerate(runnable_examples()):
        path = tmp_path / f"example_{n}.py"
        path.write_text(block)
        paths.append(str(path))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update(PYTHONPATH=str(REPO), HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", RUNNER, *paths], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ran ") == len(paths)
