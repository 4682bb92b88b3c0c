"""The listing share: when a poller may list a store without a change feed again.

A store without a change feed (TransferQueue) is listed in full on every
poll, and its controller is shared by every rollout worker: at K=100k keys one
TransferQueue ``kv_list()`` takes ~0.2-0.4 s (~35-45 ms of the controller's
CPU), at 1M ~5.8 s. ``sync()``, or a waiting verl sampler asking for a listing
every ``wait_poll_interval`` (0.02 s), would, unbounded, keep the controller
listing for us nearly all the time. :class:`ListingDuty` bounds that. The
schedule decides *when* the next listing starts, never what it shows.

**A fixed share** (a number in (0, 1], the default
:data:`DEFAULT_LISTING_SHARE`): a listing that took ``d`` seconds is followed
by the next no sooner than ``d / share`` after it started, so listings take at
most ``share`` of the wall clock whatever is asked in between (1.0: no
bound). The poll schedule adds ``poll_interval``, start to start
(:class:`~poller.polling.PollingThread`): the next listing starts no sooner
than ``max(poll_interval, d / share)`` after the last one started, and a
``sync()`` may ask for it as soon as the share allows.

The default, 0.15, is verl 0.9.1's own sampler's share at K=100k TransferQueue
keys (below: ``d`` ~0.38 s of a 2.46 s cycle), the largest store it was
measured at: the generic poller never spends a larger share of the wall clock
inside ``kv_list()`` than verl's sampler does there, at any store size. It
bites only where a listing is expensive: a listing of ``d`` is held back only
when ``d / 0.15`` exceeds ``poll_interval``, so at the default 1 s only
listings over 150 ms and at 0.1 s only those over 15 ms; a store that lists
in ~1 ms is listed every ``poll_interval``, as asked. On TransferQueue at
100k keys (the poller's own ``d`` ~0.16 s) the next listing starts ~1.07 s
after the last one began: ~0.9 listings a second (~35-45 ms of the
controller's CPU each, ~4% of a core), where verl's sampler lists 0.43 a
second; a trainer that must list no more often than verl's sampler uses
``buffer.verl`` or :data:`VERL_CYCLE`. At 1M keys (``d`` ~5.8 s) the next
listing starts ~39 s after the last one began, where a thread listing every
second would keep the controller listing ~85% of the time.

**verl's cycle** (:data:`VERL_CYCLE`, ``"verl"``: what ``buffer.verl``
passes, since it mirrors verl's sampler). verl 0.9.1's sampler
(``verl/trainer/ppo/v1/replay_buffer.py``) loops in ``sample()``:
``_sync_metadata_from_transfer_queue()`` lists the store with ``tq.kv_list()``
(every partition, ``d`` seconds) and files every key's tags, the loop decides
(evictions, sampleable groups: together ``p`` seconds), then
``_wait_for_next_poll()`` calls ``time.sleep(self.poll_interval)``; its trainer
never passes ``poll_interval``, so the constructor's default of 2.0 s holds.
One cycle is ``d + p + 2.0`` seconds of which ``d`` is inside ``kv_list()``: a
share of ``d / (d + p + 2.0)`` (K=100k TransferQueue keys: ``d`` ~0.38 s,
``p`` ~0.08 s, 0.15; 10k keys: ~0.03 s and ~0.006 s, 0.013). A fixed share
cannot match verl across sizes: verl's grows with the store, so a share fixed
at one size lists the other several times too often or too rarely.

This cycle is kept, and no shorter: the next listing starts no sooner than
:data:`VERL_POLL_INTERVAL` (2.0 s) plus the listing's own ``d`` plus twice the
poll's own processing ``p`` after the poll that took it is *done*, its
listing, diff, screen and sending all over (the polling thread says so with
:meth:`ListingDuty.poll_done`). A poll's cycle is then ``2d + 3p + 2.0`` with
the poller's own ``d`` and ``p``: the share inside ``kv_list()`` is
``d / (2d + 3p + 2.0)``. ``d`` and ``p`` count more than once because the
controller's cost of a listing is the same for both samplers, but the poller
takes a listing quicker: its client reads the controller's reply itself and
leaves each key's tags packed, and it decodes only the keys whose bytes
changed, where verl's client decodes every key and verl files each one in
Python (100k keys: ``d`` ~0.16 s and ``p`` ~0.06 s against verl's ~0.38 s
and ~0.08 s). Counted once each, its cycle was ~2.2 s against verl's
~2.3-2.45 s, up to ~10% more listings of the shared controller; with
``2d + 3p + 2.0`` it is ~2.3-2.5 s, as many listings as verl's or fewer at
the sizes measured (``python -m bench --only tq`` counts both: 0.43 a second
against verl's 0.432 at 100k keys in one run). A poll asked for sooner (a
SYNC from a waiting sampler) waits for it.

**A call that stalls or fails** (:meth:`ListingDuty.unanswered`) is not a
listing: the store did not answer, so its duration counts neither in the
share nor in the figures. With a fixed share the next call then waits only
for the poll schedule (``poll_interval`` after a stall, the backoff after a
failure: TransferQueue's ``call_timeout`` of 10 s and the default 1 s retry
~11 s after the stalled call began); with verl's cycle it comes no sooner
than :data:`VERL_POLL_INTERVAL` after the call gave up (~12 s after it began).
(Counted as a listing's ``d``, a stalled call's 10 s made verl's cycle
``2d + 2 s``: the next call 2 s + 10 s after it gave up, ~22 s after it began.)
"""

from __future__ import annotations

import collections
import math
import time
from typing import Deque

from poller.wire.arguments import VERL_CYCLE, VERL_POLL_INTERVAL, ListingShare

__all__ = ["ListingDuty"]

# Listings the measured share is taken over: enough to smooth one odd call,
# few enough that the figure follows a store that grew.
_WINDOW = 16


class ListingDuty:
    """When the next listing may start, and what the listings cost so far.

    Used by one thread (the poller's polling thread), which calls
    :meth:`record` for each full listing the store answered,
    :meth:`unanswered` for a call that stalled or failed, and
    :meth:`poll_done` when the poll that took a listing is over; the counters
    are plain floats and ints that the control loop reads for heartbeats.
    """

    def __init__(self, share: ListingShare) -> None:
        self.share = share
        self._verl = share == VERL_CYCLE
        self.listings = 0
        self.last_seconds = 0.0
        self.total_seconds = 0.0
        self._allowed_at = -math.inf
        # verl's cycle: the last listing's poll is not done yet, so its pause has not begun.
        self._poll_open = False
        self._listing_ended = -math.inf
        self._recent: Deque[tuple[float, float]] = collections.deque(maxlen=_WINDOW)  # (start, seconds)
        # The start of the last listing brought forward by a change the watch saw (poller.polling).
        self._last_brought_forward = -math.inf

    def wait_for(self, now: float | None = None) -> float:
        """Seconds until the next listing may start (0: now)."""
        now = time.monotonic() if now is None else now
        return max(0.0, self._allowed_at - now)

    def wait_for_change(self, now: float | None = None) -> float:
        """Seconds until a listing for a change the watch saw may start (0: now).

        With a fixed share, :meth:`wait_for`'s bound holds as it is (the poll
        schedule is what the change cuts short). With verl's cycle the
        listing is brought forward: verl's pace is for listings that may find
        nothing, and this one is known to find a change. It may start once
        the last listing began ``2d`` ago (the store listed at most half the
        wall clock) and :data:`VERL_POLL_INTERVAL` after the last listing
        brought forward began: a watched key that changes all the time makes
        at most one such listing per verl's sleep, so at most about twice
        verl's rate in all. The listing then counts as any other: the cycle
        starts again after it (:meth:`record`).
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
        """The store answered a full listing that began at monotonic ``started`` and took ``seconds``.

        With a fixed share the next listing may start ``seconds / share``
        after ``started``. With verl's cycle it waits for :meth:`poll_done`;
        until then it may start no sooner than :data:`VERL_POLL_INTERVAL`
        after this listing ended.
        """
        seconds = max(0.0, seconds)
        self.listings += 1
        self.last_seconds = seconds
        self.total_seconds += seconds
        self._recent.append((started, seconds))
        if self._verl:
            self._allowed_at = started + seconds + VERL_POLL_INTERVAL
            self._poll_open = True
            self._listing_ended = started + seconds
        else:
            self._allowed_at = started + seconds / float(self.share)

    def unanswered(self, ended: float) -> None:
        """A call gave up or failed at monotonic ``ended``, without a listing: the store did not answer.

        Its duration counts nowhere: not as time the store spent listing
        (the next wait is not lengthened by it), nor in the figures. With
        verl's cycle the next listing starts no sooner than
        :data:`VERL_POLL_INTERVAL` after ``ended``, as verl's sampler sleeps
        after each attempt; with a fixed share the poll schedule alone
        decides (the polling thread's pause after a stall or its backoff).
        """
        if self._verl:
            self._poll_open = False
            self._allowed_at = max(self._allowed_at, ended + VERL_POLL_INTERVAL)

    def poll_done(self, now: float | None = None) -> None:
        """The poll that took the last listing is over (its diff screened and sent, or its failure reported).

        With verl's cycle the next listing then starts no sooner than
        :data:`VERL_POLL_INTERVAL` plus the last listing's duration ``d``
        plus twice the poll's processing ``p`` (from the listing's end to
        ``now``, monotonic) after ``now``: verl's sampler sleeps 2.0 s after
        it has processed a listing, which it takes longer over (the module
        docstring). A no-op with a fixed share, after :meth:`unanswered`, and
        for a poll that took no listing (a change feed's read): once per listing.
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
