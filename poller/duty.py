"""The listing duty cycle: how much of the wall clock a poller spends inside ``kv_list()``.

A store without a change feed (TransferQueue) is listed in full on every
poll, and its controller is shared by every rollout worker: at K=100k keys one
TransferQueue ``kv_list()`` takes ~0.36 s of the controller. A waiting
sampler asks for a listing every ``wait_poll_interval`` (0.02 s), which,
unbounded, would keep the controller listing for us nearly all the time.
:class:`ListingDuty` bounds that: a listing that took ``d`` seconds is followed
by the next one no sooner than ``d / share`` after it started, so listings take
at most ``share`` of the wall clock, whatever is asked in between.

Why :data:`DEFAULT_LISTING_SHARE` is 0.014: verl 0.9.1's own sampler
(``verl/trainer/ppo/v1/replay_buffer.py``) lists the store inside
``sample()`` with ``tq.kv_list()`` (every partition), decides, and
``time.sleep(self.poll_interval)`` before the next listing; its trainer never
passes ``poll_interval``, so the constructor's default of 2.0 s holds. One
cycle is ``d + 2.0`` seconds of which ``d`` is listing, a share of
``d / (d + 2.0)``: at 10k TransferQueue keys (``d`` ~0.03 s) 0.03/2.03 =
0.0148, at 100k keys (``d`` ~0.36 s) 0.36/2.36 = 0.153. A fixed share no
higher than verl's across that range is at most 0.0148; 0.014 is the
largest value of two significant digits below it. The price is freshness
on a large store: at 100k keys the listings come every ~26 s (verl: every
2.4 s); ``listing_share`` raises it (0.15 matches verl at 100k keys, 1.0
turns the bound off).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Deque

__all__ = ["DEFAULT_LISTING_SHARE", "ListingDuty", "check_share"]

#: The most of the wall clock a poller spends listing a store without a change feed (see the module docstring).
DEFAULT_LISTING_SHARE = 0.014

# Listings the measured share is taken over: enough to smooth one odd call,
# few enough that the figure follows a store that grew.
_WINDOW = 16


def check_share(name: str, value: Any) -> float:
    """``value`` as a share of the wall clock: a number in (0, 1] (a bool is refused).

    Raises:
        ValueError: naming ``name`` and ``value``.
    """
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value)
            or not 0 < value <= 1):
        raise ValueError(f"{name} must be a share of the wall clock in (0, 1], got {value!r}")
    return float(value)


class ListingDuty:
    """When the next listing may start, and what the listings cost so far.

    Used by one thread (the poller's polling thread); the counters are plain
    floats and ints that the control loop reads for heartbeats.
    """

    def __init__(self, share: float) -> None:
        self.share = share
        self.listings = 0
        self.last_seconds = 0.0
        self.total_seconds = 0.0
        self._allowed_at = -math.inf
        self._recent: Deque[tuple[float, float]] = collections.deque(maxlen=_WINDOW)  # (start, seconds)

    def wait_for(self, now: float | None = None) -> float:
        """Seconds until the next listing may start (0: now)."""
        now = time.monotonic() if now is None else now
        return max(0.0, self._allowed_at - now)

    def record(self, started: float, seconds: float) -> None:
        """A listing began at monotonic ``started`` and took ``seconds`` (answered, failed or stalled alike:
        the store spent the time either way)."""
        seconds = max(0.0, seconds)
        self.listings += 1
        self.last_seconds = seconds
        self.total_seconds += seconds
        self._recent.append((started, seconds))
        self._allowed_at = started + seconds / self.share

    def measured_share(self, now: float | None = None) -> float:
        """The share of the wall clock spent listing over the last listings, up to now (0 before any)."""
        recent = list(self._recent)
        if not recent:
            return 0.0
        now = time.monotonic() if now is None else now
        span = now - recent[0][0]
        busy = sum(seconds for _, seconds in recent)
        return min(1.0, busy / span) if span > 0 else 1.0
