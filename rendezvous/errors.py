"""One tree of rendezvous errors, so callers can catch at the right depth.

Every error carries a one-line message fit for a user: the CLI prints
``str(exc)`` and exits non-zero, never a traceback.
"""


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
