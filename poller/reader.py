"""The source read for one poll, and the change cursor held between polls.

:class:`ListingReader` reads a source by its change feed when it has one (the SQLite store), listed in full only for
a snapshot, when the feed cannot serve the cursor, and every :data:`RECONCILE_INTERVAL` (a safety net for what a
feed could miss: triggers dropped, a deletion log trimmed by hand); 100k keys: a listing ~390 ms, a change read
~1 ms. Every full listing is timed into the listing share (:class:`~poller.duty.ListingDuty`); one that fails or
runs past ``stall_timeout`` is unanswered. What it reads becomes a :class:`~poller.diff.Diff`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator, TypeVar

from poller.common.checks import DEFAULT_LISTING_SHARE
from poller.diff import Diff, Sent
from poller.duty import ListingDuty
from poller.sources.contract import Source, capabilities
from poller.wire.protocol import Limits

__all__ = ["ListingReader", "RECONCILE_INTERVAL"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Seconds between the full listings that check a source's change feed.
RECONCILE_INTERVAL = 600.0


class ListingReader:
    """Reads the source for one poll and holds the change cursor between polls.

    The cursor :meth:`read` reached takes effect at :meth:`commit`, once the diff was sent (not on a failed poll).
    """

    def __init__(self, source: Source, *, listing_share: float = DEFAULT_LISTING_SHARE,
                 stall_timeout: float | None = None) -> None:
        #: What the source offers, checked once (the polling thread reads its watch from it too).
        self.offered = capabilities(source)
        self.feed = self.offered.change_feed
        self._list: Callable[[], Any] = self.offered.kv_list_packed or self.offered.kv_list
        self.reconcile_interval = RECONCILE_INTERVAL
        self.stall_timeout = stall_timeout
        self.duty = ListingDuty(listing_share)
        self._cursor: Any = None
        self._pending: Any = None
        self._listed_at = time.monotonic()

    def wait_for(self) -> float:
        """Seconds to wait before this poll's read (0: now): only without a change feed (:meth:`read` defers)."""
        return 0.0 if self.feed else self.duty.wait_for()

    def read(self, sent: Sent, full: bool, *, limits: Limits, size: int) -> Diff:
        """This poll's diff against ``sent`` (a full snapshot if ``full``), to be iterated as it is sent.

        A store with ``kv_snapshot_pieces()`` is read piece by piece for a snapshot. With a change feed, a later
        snapshot (a RESYNC: the receiver lost messages) is what was sent plus this poll's changes (~5x cheaper).

        Raises:
            Exception: whatever the source raised, or TypeError for a malformed answer.
        """
        self._pending = None
        if not self.feed:
            return Diff([self._listing(self._list)], sent, full=full, limits=limits, size=size)
        due = time.monotonic() - self._listed_at >= self.reconcile_interval and self.duty.wait_for() == 0
        if not due and self._cursor is not None:
            assert self.offered.kv_changes is not None  # a feed has both calls (capabilities())
            changes = self.offered.kv_changes(self._cursor)
            if changes is not None:
                cursor, upserts, deletes = changes
                self._pending = (cursor, False)
                diff = Diff([upserts], sent, full=False, complete=False, deletes=deletes, limits=limits, size=size)
                if not full:
                    return diff
                for _ in diff:  # a change set is small: applied to a copy of what was sent, sent whole
                    pass
                whole = {partition: dict(items) for partition, items in sent.items()}
                diff.commit(whole)
                snapshot = Diff((), sent, full=True, complete=False, deletes=deletes, limits=limits, size=size,
                                held=whole)
                snapshot.refused = diff.refused
                return snapshot
            # Listed at once, within the share or not: a feed that lost its cursor has nothing else to offer. Sent
            # as a snapshot: the store may be another history (a backup restored), and the buffer counts it as one.
            logger.info("the source cannot serve change cursor %r: taking a full listing", self._cursor)
            full = True
        in_pieces = self.offered.kv_snapshot_pieces
        if full and in_pieces is not None:
            began = time.monotonic()
            cursor, pieces = self._listing(in_pieces, answered=False)
            self._pending = (cursor, True)
            return Diff(self._timed(pieces, began), sent, full=True, limits=limits, size=size)
        assert self.offered.kv_snapshot is not None
        cursor, listing = self._listing(self.offered.kv_snapshot)
        self._pending = (cursor, True)
        return Diff([listing], sent, full=full, limits=limits, size=size)

    def _timed(self, pieces: Iterator[Any], began: float) -> Iterator[Any]:
        """``pieces``, the listing read in pieces, timed into the duty cycle once read whole (a poll cut short, or
        a read that failed, is no listing)."""
        try:
            yield from pieces
        finally:
            close = getattr(pieces, "close", None)
            if callable(close):
                close()
        self.duty.record(began, time.monotonic() - began)

    def _listing(self, call: Callable[[], _T], *, answered: bool = True) -> _T:
        """``call()``, a full listing, timed into the duty cycle if answered within ``stall_timeout`` (or by _timed)."""
        began = time.monotonic()
        listing = call()  # one that fails is no listing
        if not answered:
            return listing
        ended = time.monotonic()
        if self.stall_timeout is None or ended - began < self.stall_timeout:  # a stalled call is no listing
            self.duty.record(began, ended - began)
        return listing

    def include(self, partition_ids: frozenset[str]) -> None:
        """List these partitions too from now on (the source's optional ``include_partitions(ids)``)."""
        if self.offered.include_partitions is not None:
            self.offered.include_partitions(sorted(partition_ids))

    def commit(self) -> None:
        """The diff :meth:`read` returned was sent: continue from its cursor."""
        if self._pending is None:
            return
        cursor, listed = self._pending
        self._pending = None
        self._cursor = cursor
        if listed:
            self._listed_at = time.monotonic()
