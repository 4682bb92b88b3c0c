"""The listing duty cycle: how much of the wall clock a poller spends inside ``kv_list()``.

A store without a change feed (TransferQueue) is listed in full on every
poll, and its controller is shared by every rollout worker: at K=100k keys one
TransferQueue ``kv_list()`` takes ~0.2-0.4 s (~35-45 ms of the controller's CPU). A waiting
sampler asks for a listing every ``wait_poll_interval`` (0.02 s), which,
unbounded, would keep the controller listing for us nearly all the time.
:class:`ListingDuty` bounds that.

The default (``share=None``) is verl's own rule, so the poller never spends a
larger share of the wall clock inside ``kv_list()`` than the sampler it
replaces, at any store size. verl 0.9.1's
sampler (``verl/trainer/ppo/v1/replay_buffer.py``) loops in ``sample()``:
``_sync_metadata_from_transfer_queue()`` lists the store with ``tq.kv_list()``
(every partition, ``d`` seconds) and files every key's tags, the loop decides
(evictions, sampleable groups: together ``p`` seconds), then
``_wait_for_next_poll()`` calls ``time.sleep(self.poll_interval)``; its trainer
never passes ``poll_interval``, so the constructor's default of 2.0 s holds.
One cycle is ``d + p + 2.0`` seconds of which ``d`` is inside ``kv_list()``: a
share of ``d / (d + p + 2.0)`` (K=100k TransferQueue keys: ``d`` ~0.38 s,
``p`` ~0.08 s, 0.15; 10k keys: ~0.03 s and ~0.006 s, 0.013).

The default keeps that cycle, and no shorter: the next listing starts no
sooner than :data:`VERL_POLL_INTERVAL` (2.0 s) plus the listing's own ``d``
plus twice the poll's own processing ``p`` after the poll that took it is
*done*, its listing, diff, screen and sending all over (the polling thread
says so with :meth:`ListingDuty.poll_done`). A poll's cycle is then
``2d + 3p + 2.0`` with the poller's own ``d`` and ``p``: the share inside
``kv_list()`` is ``d / (2d + 3p + 2.0)``. ``d`` and ``p`` count more than
once because the controller's cost of a listing is the same for both
samplers, but the poller takes a listing quicker: its client reads the
controller's reply itself and leaves each key's tags packed, and it decodes
only the keys whose bytes changed, where verl's client decodes every key and
verl files each one in Python (100k keys: ``d`` ~0.16 s and ``p`` ~0.06 s
against verl's ~0.38 s and ~0.08 s). Counted once each, its cycle was
~2.2 s against verl's ~2.3-2.45 s, up to ~10% more listings of the shared
controller; with ``2d + 3p + 2.0`` it is ~2.3-2.5 s, as many listings as
verl's or fewer at the sizes measured (``python -m bench --only tq`` counts
both: 0.43 a second against verl's 0.432 at 100k keys in one run). A
poll asked for sooner (a SYNC from a waiting sampler, the schedule) waits
for it. A fixed share cannot match verl across sizes: verl's grows with the
store (0.013 at 10k keys, 0.15 at 100k), so a share fixed at one size lists
the other several times too often or too rarely.

A number in (0, 1] sets a fixed share instead: a listing that took ``d``
seconds is followed by the next no sooner than ``d / share`` after it
started, so listings take at most ``share`` of the wall clock, whatever is
asked in between (1.0: no bound).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Deque

__all__ = ["DEFAULT_LISTING_SHARE", "VERL_POLL_INTERVAL", "ListingDuty", "check_share"]

#: ``None``: verl's own cycle, the next listing no sooner than ``VERL_POLL_INTERVAL`` + ``d`` + ``2p`` after the poll
#: that took the previous one is done: a share of ``d / (2d + 3p + VERL_POLL_INTERVAL)`` (the module docstring).
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

    Used by one thread (the poller's polling thread), which calls
    :meth:`record` for each full listing and :meth:`poll_done` when the poll
    that took it is over; the counters are plain floats and ints that the
    control loop reads for heartbeats.
    """

    def __init__(self, share: float | None) -> None:
        self.share = share  # None: verl's own cycle, d + p + VERL_POLL_INTERVAL start to start
        self.listings = 0
        self.last_seconds = 0.0
        self.total_seconds = 0.0
        self._allowed_at = -math.inf
        # verl's cycle (share None): the last listing's poll is not done yet, so its pause has not begun.
        self._poll_open = False
        self._listing_ended = -math.inf
        self._recent: Deque[tuple[float, float]] = collections.deque(maxlen=_WINDOW)  # (start, seconds)

    def wait_for(self, now: float | None = None) -> float:
        """Seconds until the next listing may start (0: now)."""
        now = time.monotonic() if now is None else now
        return max(0.0, self._allowed_at - now)

    def record(self, started: float, seconds: float) -> None:
        """A listing began at monotonic ``started`` and took ``seconds`` (answered, failed or stalled alike:
        the store spent the time either way).

        With a fixed share the next listing may start ``seconds / share``
        after ``started``. By default it waits for :meth:`poll_done`; until
        then it may start no sooner than :data:`VERL_POLL_INTERVAL` after
        this listing ended.
        """
        seconds = max(0.0, seconds)
        self.listings += 1
        self.last_seconds = seconds
        self.total_seconds += seconds
        self._recent.append((started, seconds))
        if self.share is None:
            self._allowed_at = started + seconds + VERL_POLL_INTERVAL
            self._poll_open = True
            self._listing_ended = started + seconds
        else:
            self._allowed_at = started + seconds / self.share

    def poll_done(self, now: float | None = None) -> None:
        """The poll that took the last listing is over (its diff screened and sent, or its failure reported).

        By default the next listing then starts no sooner than
        :data:`VERL_POLL_INTERVAL` plus the last listing's duration ``d``
        plus twice the poll's processing ``p`` (from the listing's end to
        ``now``, monotonic) after ``now``: verl's sampler sleeps 2.0 s after
        it has processed a listing, which it takes longer over (the module
        docstring). A no-op with a fixed share, and for a poll that took no
        listing (a change feed's read): once per listing.
        """
        if not self._poll_open:
            return
        self._poll_open = False
        now = time.monotonic() if now is None else now
        processing = max(0.0, now - self._listing_ended)
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
