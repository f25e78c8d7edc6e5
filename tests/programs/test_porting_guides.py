"""The porting guides (docs/porting/*.md): every python block compiles, and every file of the
repository they cite exists (a guide that names a test or an example the reader cannot find
is wrong)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GUIDES = ("from-torchrun-ddp.md", "from-horovod.md", "from-fsdp2.md", "from-lightning-accelerate-hf.md")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CITED = re.compile(r"`((?:tests|docs|examples|elastic|benchmarks)/[\w./-]+\.(?:py|md))`")


@pytest.mark.parametrize("name", GUIDES)
def test_every_python_block_of_the_guide_compiles(name):
    text = (REPO / "docs" / "porting" / name).read_text()
    blocks = BLOCK.findall(text)
    assert blocks, f"{name} has no python block"
    for number, block in enumerate(blocks, 1):
        compile(block, f"{name} block {number}", "exec")


@pytest.mark.parametrize("name", GUIDES)
def test_every_file_the_guide_cites_exists(name):
    text = (REPO / "docs" / "porting" / name).read_text()
    missing = [path for path in CITED.findall(text) if not (REPO / path).exists()]
    assert not missing, f"{name} cites files that do not exist: {missing}"
