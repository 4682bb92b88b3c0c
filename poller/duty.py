"""The listing share: when a poller may list a store without a change feed again.

Such a store (TransferQueue) is listed in full on every poll, and its controller serves every rollout worker:
unbounded, ``sync()`` or a waiting decision would keep it listing for us nearly all the time.
:class:`ListingDuty` decides *when* the next listing may start, never what it shows (docs/transferqueue.md).

- **A fixed share** in (0, 1] (default 0.15, 1: no bound): after a listing of ``d`` seconds the next starts no
  sooner than ``d / share`` after it started.
- **A change the watch saw** (:mod:`poller.watch`) brings a listing forward, no sooner than ``every`` seconds
  after the last one it brought forward (the waiting decision says how often: buffer.verl, its ``poll_interval``,
  so that it lists no more often than verl's own sampler would for the same call).

A call that stalls or fails is not a listing: its duration counts nowhere.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Deque

from poller.common.checks import DEFAULT_LISTING_SHARE

__all__ = ["ListingDuty"]

# Listings the measured share is taken over: enough to smooth one odd call, few enough to follow growth.
_WINDOW = 16


class ListingDuty:
    """When the next listing may start, and what the listings cost so far (counters read for heartbeats)."""

    def __init__(self, share: float = DEFAULT_LISTING_SHARE) -> None:
        self.share = share
        self.listings = 0
        self.last_seconds = 0.0
        self.total_seconds = 0.0
        self._allowed_at = -math.inf
        self._recent: Deque[tuple[float, float]] = collections.deque(maxlen=_WINDOW)  # (start, seconds)
        # The start of the last listing brought forward by a change the watch saw (poller.watch).
        self._last_brought_forward = -math.inf

    def wait_for(self, now: float | None = None) -> float:
        """Seconds until the next listing may start (0: now)."""
        now = time.monotonic() if now is None else now
        return max(0.0, self._allowed_at - now)

    def wait_for_change(self, every: float, now: float | None = None) -> float:
        """Seconds until a listing for a change the watch saw may start (0: now): within the share, and no sooner
        than ``every`` after the last listing a change brought forward."""
        now = time.monotonic() if now is None else now
        return max(0.0, self._allowed_at - now, self._last_brought_forward + every - now)

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
        self._allowed_at = started + seconds / float(self.share)

    def measured_share(self, now: float | None = None) -> float:
        """The share of the wall clock spent listing over the last listings, up to now (0 before any)."""
        recent = list(self._recent)
        if not recent:
            return 0.0
        now = time.monotonic() if now is None else now
        span = now - recent[0][0]
        busy = sum(seconds for _, seconds in recent)
        return min(1.0, busy / span) if span > 0 else 1.0
