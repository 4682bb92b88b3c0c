"""The listing share: when a poller may list a store without a change feed again.

Such a store (TransferQueue) is listed in full on every poll, and its controller serves every rollout worker:
unbounded, ``sync()`` or a waiting verl sampler would keep it listing for us nearly all the time.
:class:`ListingDuty` decides *when* the next listing may start, never what it shows (docs/transferqueue.md).

- **A fixed share** in (0, 1] (default 0.15, verl 0.9.1's sampler's own at 100k keys): after a listing of ``d``
  seconds the next starts no sooner than ``d / share`` after it started.
- **verl's cycle** (:data:`VERL_CYCLE`): verl's sampler lists (``d``), processes (``p``), then sleeps 2 s. The
  next listing starts no sooner than 2 s + ``d`` + ``2p`` after the poll that took the last one is done: the
  poller lists quicker than verl at the same cost to the controller (~10% more often).

A call that stalls or fails is not a listing: its duration counts nowhere.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Deque

from poller.wire.arguments import VERL_CYCLE, VERL_POLL_INTERVAL, ListingShare

__all__ = ["ListingDuty"]

# Listings the measured share is taken over: enough to smooth one odd call, few enough to follow growth.
_WINDOW = 16


class ListingDuty:
    """When the next listing may start, and what the listings cost so far (counters read for heartbeats)."""

    def __init__(self, share: ListingShare) -> None:
        self.share = share
        self._verl = share == VERL_CYCLE
        self.listings = 0
        self.last_seconds = 0.0
        self.total_seconds = 0.0
        self._allowed_at = -math.inf
        # verl's cycle: the last listing's poll is not done yet, so its pause has not begun.
        self._poll_open = False
        self._recent: Deque[tuple[float, float]] = collections.deque(maxlen=_WINDOW)  # (start, seconds)
        # The start of the last listing brought forward by a change the watch saw (poller.polling).
        self._last_brought_forward = -math.inf

    def wait_for(self, now: float | None = None) -> float:
        """Seconds until the next listing may start (0: now)."""
        now = time.monotonic() if now is None else now
        return max(0.0, self._allowed_at - now)

    def wait_for_change(self, now: float | None = None) -> float:
        """Seconds until a listing for a change the watch saw may start (0: now).

        A fixed share keeps :meth:`wait_for`'s bound. verl's cycle brings a listing known to find a change forward:
        ``2d`` after the last began (the store listing at most half the time) and :data:`VERL_POLL_INTERVAL` after
        the last one brought forward, so at most about twice verl's rate.
        """
        now = time.monotonic() if now is None else now
        if not self._verl:
            return self.wait_for(now)
        last_start = self._recent[-1][0] if self._recent else -math.inf
        allowed = max(last_start + 2 * self.last_seconds, self._last_brought_forward + VERL_POLL_INTERVAL)
        return max(0.0, min(allowed, self._allowed_at) - now)

    def brought_forward(self, started: float) -> None:
        """The listing that began at monotonic ``started`` was brought forward by a change the watch saw."""
        self._last_brought_forward = started

    def record(self, started: float, seconds: float) -> None:
        """The store answered a full listing that began at monotonic ``started`` and took ``seconds``."""
        seconds = max(0.0, seconds)
        self.listings += 1
        self.last_seconds = seconds
        self.total_seconds += seconds
        self._recent.append((started, seconds))
        if self._verl:
            self._allowed_at = started + seconds + VERL_POLL_INTERVAL
            self._poll_open = True
        else:
            self._allowed_at = started + seconds / float(self.share)

    def unanswered(self, ended: float) -> None:
        """A call gave up or failed at monotonic ``ended``: the store did not answer.

        verl's cycle waits :data:`VERL_POLL_INTERVAL`, as verl's sampler sleeps after each attempt; a fixed share
        leaves it to the poll schedule (pause, backoff).
        """
        if self._verl:
            self._poll_open = False
            self._allowed_at = max(self._allowed_at, ended + VERL_POLL_INTERVAL)

    def poll_done(self, now: float | None = None) -> None:
        """The poll that took the last listing is over (its diff sent, or its failure reported).

        verl's cycle: the next listing no sooner than :data:`VERL_POLL_INTERVAL` + ``d`` + ``2p`` after ``now``
        (``p``: from the listing's end to ``now``). Otherwise a no-op.
        """
        if not self._poll_open:
            return
        self._poll_open = False
        now = time.monotonic() if now is None else now
        processing = max(0.0, now - sum(self._recent[-1]))  # since the listing ended
        self._allowed_at = max(self._allowed_at, now + VERL_POLL_INTERVAL + self.last_seconds + 2 * processing)

    def measured_share(self, now: float | None = None) -> float:
        """The share of the wall clock spent listing over the last listings, up to now (0 before any)."""
        recent = list(self._recent)
        if not recent:
            return 0.0
        now = time.monotonic() if now is None else now
        span = now - recent[0][0]
        busy = sum(seconds for _, seconds in recent)
        return min(1.0, busy / span) if span > 0 else 1.0
