"""One tree of rendezvous errors, so callers can catch at the right depth.

Every error carries a one-line message fit for a user: the CLI prints
``str(exc)`` and exits non-zero, never a traceback.
"""

from contextlib import contextmanager


class RendezvousError(Exception):
    """Base of every error raised by the rendezvous package."""


class ConfigError(RendezvousError, ValueError):
    """A malformed setting (endpoint, TTL, TLS file...): the user must fix input."""


class RendezvousConnectionError(RendezvousError):
    """etcd could not be reached (or refused us) within the configured bound."""


class RendezvousAuthError(RendezvousConnectionError):
    """etcd refused the credentials (wrong user or password, bad certificate)."""


class RendezvousTimeoutError(RendezvousError):
    """A round did not close in time (for example: fewer than min_np members)."""


class RendezvousClosedError(RendezvousError):
    """The job is over (finished or failed); no further rounds will form."""


class LeaseLostError(RendezvousError):
    """Our lease expired or was revoked: the keys that hung on it are gone."""


class MalformedValueError(RendezvousError, ValueError):
    """A value in the job's etcd prefix that does not parse or has the wrong shape: written
    by another version of elastic-run, by hand, or by someone who should not. Readers skip
    it (naming the key once) instead of failing or wedging on it."""


# What parsing JSON of an unexpected shape raises: bad JSON or UTF-8 (ValueError), a
# missing field (KeyError), a field of the wrong type (TypeError, AttributeError,
# IndexError).
_PARSE_ERRORS = (ValueError, KeyError, TypeError, AttributeError, IndexError)


@contextmanager
def parsing(what: str):
    """Turn any error of parsing ``what`` into one MalformedValueError line."""
    try:
        yield
    except MalformedValueError:
        raise
    except _PARSE_ERRORS as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise MalformedValueError(f"malformed {what} ({detail[:200]})") from None


def text(value, what: str) -> str:
    """``value`` if it is a string, else a TypeError naming ``what`` (inside ``parsing``)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {type(value).__name__}")
    return value


def texts(values, what: str) -> tuple:
    """A tuple of strings from a JSON list (inside ``parsing``)."""
    if not isinstance(values, list):
        raise TypeError(f"{what} must be a list, not {type(values).__name__}")
    return tuple(text(v, what) for v in values)
