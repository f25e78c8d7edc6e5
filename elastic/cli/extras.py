"""Optional dependencies a command needs: a missing one is one line naming the extra to
install (``pip install matplotlib``, or the checkout's extra: ``pip install -e '.[timeline]'``: elastic-run
is not on PyPI) and exit status 1, never a traceback."""

from __future__ import annotations

import importlib


class MissingExtra(Exception):
    """An optional dependency is not installed (or does not import)."""


def require(module: str, extra: str, needed_for: str) -> None:
    """Import ``module`` or raise MissingExtra saying which extra brings it."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{needed_for} needs {module}, which is not installed or does not import "
                           f"({type(exc).__name__}: {exc}); install it with: pip install {module} (in a checkout: "
                           f"pip install -e '.[{extra}]')")
