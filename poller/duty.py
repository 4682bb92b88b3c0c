"""The listing duty cycle: how much of the wall clock a poller spends inside ``kv_list()``.

A store without a change feed (TransferQueue) is listed in full on every
poll, and its controller is shared by every rollout worker: at K=100k keys one
TransferQueue ``kv_list()`` takes ~0.36 s of the controller. A waiting
sampler asks for a listing every ``wait_poll_interval`` (0.02 s), which,
unbounded, would keep the controller listing for us nearly all the time.
:class:`ListingDuty` bounds that: a listing that took ``d`` seconds is followed
by the next one no sooner than ``d / share`` after it started, so listings take
at most ``share`` of the wall clock, whatever is asked in between.

The default (``share=None``) is verl's own rule, so the poller never spends
more of the store than the sampler it replaces, at any store size. verl 0.9.1's
sampler (``verl/trainer/ppo/v1/replay_buffer.py``) lists the store inside
``sample()`` with ``tq.kv_list()`` (every partition), decides, and
``time.sleep(self.poll_interval)`` before the next listing; its trainer never
passes ``poll_interval``, so the constructor's default of 2.0 s holds. One
cycle is ``d + 2.0`` seconds of which ``d`` is listing: a share of
``d / (d + 2.0)``, 0.0148 at 10k TransferQueue keys (``d`` ~0.03 s) and 0.153
at 100k keys (``d`` ~0.36 s). The default share *is* that share at each
listing's ``d``: the next listing starts no sooner than ``d / (d / (d + 2.0))
= d + 2.0`` seconds after one started. A fixed share cannot match it across
sizes: one low enough for 10k keys (0.014) lists 100k keys every ~26 s, ten
times less often than verl, and one right for 100k keys (0.15) lists 10k keys
ten times as often. A number in (0, 1] sets a fixed share instead (1.0: no
bound).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Deque

__all__ = ["DEFAULT_LISTING_SHARE", "VERL_POLL_INTERVAL", "ListingDuty", "check_share"]

#: ``None``: verl's own share at each listing's duration, ``d / (d + VERL_POLL_INTERVAL)`` (the module docstring).
DEFAULT_LISTING_SHARE: float | None = None
#: Seconds verl 0.9.1's sampler sleeps between two listings of the store (its default ``poll_interval``).
VERL_POLL_INTERVAL = 2.0

# Listings the measured share is taken over: enough to smooth one odd call,
# few enough that the figure follows a store that grew.
_WINDOW = 16


def check_share(name: str, value: Any) -> float | None:
    """``value`` as a share of the wall clock: a number in (0, 1] (a bool is refused), or None (verl's rule).

    Raises:
        ValueError: naming ``name`` and ``value``.
    """
    if value is None:
        return None
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value)
            or not 0 < value <= 1):
        raise ValueError(f"{name} must be a share of the wall clock in (0, 1], or None for verl's own, "
                         f"got {value!r}")
    return float(value)


class ListingDuty:
    """When the next listing may start, and what the listings cost so far.

    Used by one thread (the poller's polling thread); the counters are plain
    floats and ints that the control loop reads for heartbeats.
    """

    def __init__(self, share: float | None) -> None:
        self.share = share  # None: verl's own, d / (d + VERL_POLL_INTERVAL) at each listing
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
        gap = seconds + VERL_POLL_INTERVAL if self.share is None else seconds / self.share
        self._allowed_at = started + gap

    def measured_share(self, now: float | None = None) -> float:
        """The share of the wall clock spent listing over the last listings, up to now (0 before any)."""
        recent = list(self._recent)
        if not recent:
            return 0.0
        now = time.monotonic() if now is None else now
        span = now - recent[0][0]
        busy = sum(seconds for _, seconds in recent)
        return min(1.0, busy / span) if span > 0 else 1.0
