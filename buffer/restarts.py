"""When a dead poller is restarted, and when the buffer gives up.

Restarts are counted within a sliding window: a poller is restarted while
fewer than ``max_restarts`` restarts happened in the last ``restart_window``
seconds. A crash after hours of health therefore finds the budget whole, and
a poller that dies again and again uses it up within seconds (then
``sample()`` raises :class:`~poller.PollerCrashed`).

A start-up that failed because the store could not be reached
(:attr:`~poller.PollerStartupError.unavailable`) uses no budget: the buffer
tries again, backing off to at most :data:`UNAVAILABLE_BACKOFF_CAP` seconds
between tries, until the store answers or the buffer is closed.
"""

from __future__ import annotations

import collections
import time

__all__ = ["RestartBudget"]

RESTART_BACKOFF_BASE = 0.1
RESTART_BACKOFF_CAP = 2.0
UNAVAILABLE_BACKOFF_CAP = 5.0


class RestartBudget:
    """``max_restarts`` restarts per ``window`` seconds, and the waits between tries."""

    def __init__(self, max_restarts: int, window: float) -> None:
        self.max_restarts = max_restarts
        self.window = window
        # Every restart in the buffer's lifetime (stats()["restarts"], a Prometheus counter): it only grows.
        self.total = 0
        self._times: collections.deque[float] = collections.deque()
        # The last restart counted was refunded (its store refused it): the next try is the same restart.
        self._refunded = False

    def recent(self) -> int:
        """Restarts within the last ``window`` seconds."""
        horizon = time.monotonic() - self.window
        while self._times and self._times[0] <= horizon:
            self._times.popleft()
        return len(self._times)

    def exhausted(self) -> bool:
        return self.recent() >= self.max_restarts

    def use(self) -> None:
        """Count one restart now (before it starts: its data may arrive before start() returns).

        Tries after a refund are the same restart: :attr:`total` counts it once.
        """
        self._times.append(time.monotonic())
        if not self._refunded:
            self.total += 1
        self._refunded = False

    def refund(self) -> None:
        """Give back the budget of the restart just counted: the store refused it, and refusals use none.

        :attr:`total` keeps it (a lifetime counter never goes down); the next
        :meth:`use` is the same restart tried again and is not counted twice.
        """
        if self._times:
            self._times.pop()
            self._refunded = True

    def backoff(self) -> float:
        """The wait before the next restart: doubles with the restarts in the window."""
        return min(RESTART_BACKOFF_BASE * 2 ** self.recent(), RESTART_BACKOFF_CAP)

    @staticmethod
    def unavailable_backoff(refused: int) -> float:
        """The wait before try ``refused + 1`` at a store that could not be reached."""
        return min(RESTART_BACKOFF_BASE * 2 ** max(0, refused - 1), UNAVAILABLE_BACKOFF_CAP)
