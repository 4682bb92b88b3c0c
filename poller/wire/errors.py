"""Exceptions with exact meanings; a poller process's failure rides on ``__cause__`` as a :class:`RemoteTraceback`."""

from __future__ import annotations

__all__ = ["PollerError", "PollerStartupError", "PollerCrashed", "ProtocolError", "RemoteTraceback"]


class PollerError(Exception):
    """Base class of every error this package raises on purpose."""


class PollerStartupError(PollerError):
    """The poller process could not be started or never said READY.

    ``unavailable``: the same start may work later (the source's factory raised ``ConnectionError``
    or ``TimeoutError``, or no READY came in time); False for a broken poller (bad spec, a crash...).
    """

    def __init__(self, *args: object, unavailable: bool = False) -> None:
        super().__init__(*args)
        self.unavailable = unavailable


class PollerCrashed(PollerError):
    """The poller process died and will not be restarted any more."""


class ProtocolError(PollerError):
    """A message could not be encoded or decoded under the wire protocol."""


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in another process, printed as a ``__cause__``."""

    def __init__(self, exc_type: str, message: str, traceback_text: str) -> None:
        super().__init__(exc_type, message, traceback_text)
        self.exc_type = exc_type
        self.message = message
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        text = self.traceback_text.rstrip()
        if not text:
            return f"{self.exc_type}: {self.message}"
        return f'\n"""\n{text}\n"""'
