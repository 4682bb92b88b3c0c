"""Rate-limited logging for what peers can make the trainer log (protocol errors, forwarded LOG/ERROR, gaps).

A burst per category, then a trickle, and the next record that passes counts what was dropped: a hostile
peer cannot flood the log, a real problem still shows.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

__all__ = ["LogLimiter", "clamp_level", "MAX_FORWARDED_CHARS"]

#: Forwarded text is cut to this many characters (a LOG body may hold 1 MiB).
MAX_FORWARDED_CHARS = 2000


def clamp_level(level: int) -> int:
    """A peer's log level, kept between DEBUG and ERROR: a peer claiming CRITICAL (or 50_000) must not
    outrank the trainer's own errors, and a level below DEBUG is not one a handler expects."""
    return min(max(level, logging.DEBUG), logging.ERROR)


class LogLimiter:
    """At most ``burst`` records per category at once, refilled at ``burst / per`` a second.

    Categories are fixed names chosen by the code, never a peer's strings, so the state stays bounded;
    ``budgets`` gives some a ``(burst, per)`` of their own.
    """

    def __init__(self, logger: logging.Logger, *, burst: int = 10, per: float = 60.0,
                 budgets: dict[str, tuple[int, float]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._default = (float(burst), burst / per)
        self._budgets = {name: (float(b), b / p) for name, (b, p) in (budgets or {}).items()}
        self._clock = clock
        self._tokens: dict[str, float] = {}
        self._updated: dict[str, float] = {}
        self.suppressed: dict[str, int] = {}

    def log(self, category: str, level: int, msg: str, *args: Any, logger: logging.Logger | None = None) -> bool:
        """Log ``msg % args`` unless ``category`` is over its rate; True if it was logged."""
        now = self._clock()
        burst, rate = self._budgets.get(category, self._default)
        tokens = min(burst, self._tokens.get(category, burst) + (now - self._updated.get(category, now)) * rate)
        self._updated[category] = now
        if tokens < 1.0:
            self._tokens[category] = tokens
            self.suppressed[category] = self.suppressed.get(category, 0) + 1
            return False
        self._tokens[category] = tokens - 1.0
        dropped = self.suppressed.pop(category, 0)
        if dropped:
            msg += " (%d similar records were suppressed)"
            args = (*args, dropped)
        (logger or self._logger).log(level, msg, *args)
        return True
