"""Keys whose values do not parse: named once in the log, then skipped.

A value in the job's prefix may come from another version of elastic-run, a hand edit or
someone who should not write there. Whoever reads it (the coordinator, the control
channel, ``elastic-run status``) treats the key as absent and says so once per value, so
one bad key neither wedges the job nor floods the log.
"""

from __future__ import annotations

import logging

from .errors import MalformedValueError

log = logging.getLogger(__name__)

_REMEMBERED = 1024  # keys said; beyond, start afresh (a flood is still bounded by this)


class SkippedKeys:
    def __init__(self, reader: str):
        self._reader = reader
        self._said: dict[str, int] = {}  # key -> hash of the value said

    def skip(self, key: str, value: bytes, error: MalformedValueError) -> None:
        fingerprint = hash(value)
        if self._said.get(key) == fingerprint:
            return
        if len(self._said) >= _REMEMBERED:
            self._said.clear()
        self._said[key] = fingerprint
        log.warning("%s: skipping %s: %s", self._reader, key, error)
