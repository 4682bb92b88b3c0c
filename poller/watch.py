"""The watch: between listings, cheap reads of the keys a waiting decision waits on (``kv_watch``).

A WATCH from the buffer names a partition's keys, for how long, and how often a change may bring a listing
forward. :class:`KeyWatch` reads them at a pace tied to what a listing costs (:data:`WATCH_BUDGET`) and says when
a read showed what the buffer was not sent; the polling thread (:mod:`poller.polling`) then lists as soon as the
listing share (:mod:`poller.duty`) and ``every`` allow. The watch decides *when* the store is listed, never what
the buffer shows: that still comes from listings.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Mapping

from poller.duty import ListingDuty
from poller.sources.contract import WatchRead, WatchReader
from poller.wire.tags import thaw

__all__ = ["KeyWatch", "WATCH_BUDGET", "WATCH_INTERVAL", "WATCH_INTERVAL_MAX", "WATCH_TIMEOUT"]

logger = logging.getLogger(__name__)

#: Reads of the watched keys while a decision waits on them (``kv_watch``: ~1% of a listing's cost at 100k keys).
#: A read of ``r`` s comes ``(r / d) / WATCH_BUDGET`` s after the one before began (``d``: the last listing's
#: duration), within WATCH_INTERVAL and WATCH_INTERVAL_MAX; one not answered within WATCH_TIMEOUT tells nothing.
WATCH_INTERVAL = 0.3
WATCH_BUDGET = 0.25
WATCH_INTERVAL_MAX = 0.6
WATCH_TIMEOUT = 1.0

#: What is watched: a partition and its keys.
Watched = tuple[str, tuple[str, ...]]


class KeyWatch:
    """The keys watched now, their reads, and whether one showed a change the listings have not sent.

    ``read`` is the source's ``kv_watch`` (None: a source without one, where every request is a no-op).
    """

    def __init__(self, read: WatchReader | None, duty: ListingDuty) -> None:
        self._read = read
        self._duty = duty
        # (watched, until), replaced whole by the control loop's thread; the last read's watched keys and
        # fingerprint (None: the next read compares with what was sent); when the next read is due.
        self._current: tuple[Watched, float] | None = None
        self._baseline: tuple[Watched, bytes] | None = None
        self._next_read = -math.inf
        #: A read saw a change since the last listing.
        self.change_seen = False
        #: The least time between two listings a change brings forward (the WATCH in force says).
        self.every = 0.0
        # Read by the control loop for heartbeats: reads so far, listings a change brought forward.
        self.reads = 0
        self.listings = 0

    def request(self, partition: str, keys: list[str], seconds: float, every: float) -> bool:
        """Watch ``keys`` of ``partition`` for ``seconds`` from now (no keys or 0 s: stop); True when a watch began."""
        if self._read is None:
            return False
        if not keys or seconds <= 0:
            self._current = None
            return False
        self.every = every
        self._current = ((partition, tuple(keys)), time.monotonic() + seconds)
        return True

    def due(self, now: float) -> tuple[Watched, float] | None:
        """The watched keys while a watch lasts, and when next read (now, if other keys than last)."""
        current = self._current
        if current is None or now >= current[1]:
            return None
        watched, baseline = current[0], self._baseline
        return watched, now if baseline is not None and baseline[0] != watched else self._next_read

    def wait_for_change(self, now: float | None = None) -> float:
        """Seconds until a listing for the change seen may start (within the share, ``every`` after the last)."""
        return self._duty.wait_for_change(self.every, now)

    def read(self, watched: Watched, now: float, sent: Mapping[str, Mapping[str, bytes]]) -> None:
        """Read the watched keys; a change the buffer was not sent (``sent``: what the listings sent) sets
        :attr:`change_seen`."""
        assert self._read is not None  # a watch is set only for a source with kv_watch
        partition, keys = watched
        try:
            read = self._read(partition, keys, WATCH_TIMEOUT)
        except Exception as exc:  # a read that fails tells nothing: the listings go on as scheduled
            logger.debug("kv_watch() of %d key(s) of %r failed: %r", len(keys), partition, exc)
            read = None
        else:
            self.reads += 1
        took = time.monotonic() - now
        listing = self._duty.last_seconds
        pace = (took / listing) / WATCH_BUDGET if listing > 0 else 0.0
        self._next_read = now + min(max(WATCH_INTERVAL, pace), WATCH_INTERVAL_MAX)
        if read is None:
            return
        baseline = self._baseline
        if baseline is not None and baseline[0] == watched:
            changed = read.fingerprint != baseline[1]
        else:
            changed = _not_sent(keys, read, sent.get(partition, {}))
        self._baseline = (watched, read.fingerprint)
        if changed:
            self.change_seen = True

    def listing_began(self, began: float) -> None:
        """A listing began at monotonic ``began``: the next read compares with what it sends (a change it misses is
        one it did not list); counted as brought forward when a change the watch saw asked for it."""
        if self.change_seen:
            self.listings += 1
            self._duty.brought_forward(began)
        self.change_seen = False
        self._baseline = None


def _not_sent(keys: tuple[str, ...], read: WatchRead, sent: Mapping[str, bytes]) -> bool:
    """Whether ``read`` shows the keys otherwise than the listings sent them (False when it cannot tell)."""
    found, tags = read.held()
    if found < len(keys):
        return True  # a key the buffer holds is gone from the store
    if tags is None:
        return False
    for key in keys:
        held = sent.get(key)
        if held is None or tags.get(key) != thaw(held):
            return True
    return False
