"""A test's fault plan for its workers (see sitecustomize.py beside this file)."""

from pathlib import Path

HERE = Path(__file__).parent
HELD_PREFIX = ".held-step-"  # the write gate's "held" files: PATH + HELD_PREFIX + step


def env(**faults: str) -> dict[str, str]:
    """The environment that installs ``faults`` in every worker, e.g.
    ``env(FAULT_DIE_ENTERING_ROUND=f"1:{marker}")``."""
    return {"PYTHONPATH": str(HERE), **faults}
