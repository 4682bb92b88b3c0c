"""Reading a source as a diff: by its change feed when it has one, else by ``kv_list()``.

A source with :class:`~poller.wire.sources.ChangeFeed` (the embedded SQLite store)
is listed in full only for a snapshot (start, RESYNC), when it cannot serve
the cursor, and once every ``reconcile_interval``; every other poll reads
what changed since the last committed cursor, so a poll costs in proportion
to the change, not to the store (K=100k SQLite keys: one listing ~390 ms,
one change read of a few hundred keys ~1 ms).

The reconciliation is a safety net, not part of correctness: it diffs a
full listing against what was sent, like a poll without a change feed, and
only what differs goes on the wire. It catches what the feed could miss
through no fault of the poller (rows edited with the store's triggers
dropped, a deletion log trimmed by hand) within a bounded time, at the cost
of one listing per interval (at 1M keys ~4 s of the poller's CPU every
10 min, under 1% of a core).

Every full listing the store answers (``kv_list()``, ``kv_snapshot()``) is
timed into the listing share (:class:`~poller.duty.ListingDuty`); a call that
fails, gives up at its own deadline or runs past ``stall_timeout`` is not a
listing, and its duration counts nowhere (:meth:`~poller.duty.ListingDuty.unanswered`:
the store did not answer, it did not spend that time listing for us). Without
a change feed the polling thread waits :meth:`ListingReader.wait_for` before
each poll; with one, a reconciliation due before the share allows it reads the
change feed once more instead. Change reads (and RESYNCs, answered from them)
are not held.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator, Mapping, TypeVar

from poller.duty import ListingDuty
from poller.listing import Listing, ListingDiff, RawSnapshot, checked_listing, diff_raw_listing
from poller.wire.arguments import DEFAULT_LISTING_SHARE, ListingShare
from poller.wire.sources import Source, has_change_feed, packed_listing

__all__ = ["DEFAULT_RECONCILE_INTERVAL", "ListingReader", "diff_changes"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Seconds between the full listings that check a source's change feed; None: never.
DEFAULT_RECONCILE_INTERVAL = 600.0

def diff_changes(sent: Listing, upserts: Any, deletes: Any, copy: bool = True) -> ListingDiff:
    """Check a ``kv_changes()`` result and turn it into the diff against ``sent``.

    Upserts whose tags equal what was sent are dropped, as are deletes of
    keys that were never sent (or are upserted in the same change set).
    Only what goes into the diff is copied. One bad record is the record's
    problem, never the change set's: an upsert the stream cannot carry is
    refused (``diff.refused``, :func:`~poller.listing.diff_raw_listing`),
    and a delete of a key or in a partition that is not a ``str`` (a BLOB
    key of the SQLite store, say) names nothing ever sent, so it is skipped
    here; the poller's :class:`~poller.quarantine.Quarantine` lets the
    record go if it held it, and counts it otherwise.

    Raises:
        TypeError: the change set is not ``{partition: {key: tags}}`` /
            ``{partition: [key, ...]}`` (the source's answer, not one
            record, is wrong), naming the first offending entry.
    """
    diff = diff_raw_listing(sent, upserts, full=False, complete=False, copy=copy)
    if deletes is None:
        deletes = {}
    if not isinstance(deletes, Mapping):
        raise TypeError(f"kv_changes() deletes are {type(deletes).__name__}, expected a mapping of partitions")
    for partition, keys in deletes.items():
        if isinstance(keys, (str, bytes, Mapping)) or not hasattr(keys, "__iter__"):
            raise TypeError(f"kv_changes() deletes[{partition!r}] is {type(keys).__name__}, expected a list of keys")
        held = sent.get(partition) if isinstance(partition, str) else None
        if not held:
            continue
        upserted = diff.upserts.get(partition, {})
        gone = [key for key in keys if isinstance(key, str) and key in held and key not in upserted]
        if gone:
            diff.deletes.setdefault(partition, []).extend(gone)
    return diff


def _whole(sent: Listing, changes: ListingDiff) -> ListingDiff:
    """A full diff from what was sent and a change set against it: every key the store holds now.

    The keys unchanged are ``sent``'s own dicts (so the screen passes over them).
    """
    upserts = {partition: dict(items) for partition, items in sent.items()}
    for partition, items in changes.upserts.items():
        upserts.setdefault(partition, {}).update(items)
    for partition, keys in changes.deletes.items():
        held = upserts.get(partition)
        if held is not None:
            for key in keys:
                held.pop(key, None)
    return ListingDiff({p: items for p, items in upserts.items() if items}, {}, changes.refused)


def _diffed(sent: Listing, raw: Any, full: bool, copy: bool) -> ListingDiff | RawSnapshot:
    """A listing's diff against ``sent``; a full one is left to be diffed as it is sent.

    Raises:
        TypeError: ``raw`` is not a mapping (see :func:`diff_raw_listing`).
    """
    if not full:
        return diff_raw_listing(sent, raw, full, copy=copy)
    return RawSnapshot(checked_listing(raw), copy)


class ListingReader:
    """Reads the source for one poll and holds the change cursor between polls.

    :meth:`read` returns the diff against ``sent``; the cursor it reached
    takes effect only with :meth:`commit`, called once the diff was sent and
    committed to ``sent``. The diff may hold the source's own tag dicts: its
    caller keeps what was sent packed (:func:`~poller.listing.commit_listing`
    with ``packed``), not those dicts.
    A poll that failed half-way is read again from the old cursor, so no
    change is lost. A full listing answered in ``stall_timeout`` seconds or
    more is a stall (the poller counts it so) and is not timed into the
    share as a listing (:meth:`~poller.duty.ListingDuty.unanswered`).
    """

    def __init__(self, source: Source, *, reconcile_interval: float | None = DEFAULT_RECONCILE_INTERVAL,
                 listing_share: ListingShare = DEFAULT_LISTING_SHARE, stall_timeout: float | None = None) -> None:
        self._source: Any = source
        self.feed = has_change_feed(source)
        self._list: Callable[[], Any] = packed_listing(source) or source.kv_list
        self.reconcile_interval = reconcile_interval
        self.stall_timeout = stall_timeout
        self.duty = ListingDuty(listing_share)
        self._cursor: Any = None
        self._pending: Any = None
        self._listed_at = time.monotonic()
        # What the last read was: a complete listing (every key the store
        # holds), or a change set and the deletions it reported.
        self.last_complete = True
        self.last_deletes: Mapping[str, Any] = {}

    def wait_for(self, full: bool) -> float:
        """Seconds to wait before this poll's read (0: read now), to keep listings within the share.

        Only a source without a change feed waits: each of its reads is a
        full listing. A source with one is read now: a change read costs
        milliseconds, a RESYNC is answered from what was sent, and a due
        reconciliation is deferred by :meth:`read` instead.
        """
        return 0.0 if self.feed else self.duty.wait_for()

    def read(self, sent: Listing, full: bool) -> ListingDiff:
        """The diff of this poll against ``sent``, whole (:meth:`read_to_send`, a full listing diffed at once)."""
        got = self.read_to_send(sent, full)
        return got.diff(sent) if isinstance(got, RawSnapshot) else got

    def read_to_send(self, sent: Listing, full: bool) -> ListingDiff | RawSnapshot:
        """The diff of this poll against ``sent`` (a full snapshot if ``full``).

        A full listing comes back as a :class:`~poller.listing.RawSnapshot`,
        checked to be a mapping but diffed piece by piece as it is sent
        (:class:`~poller.pieces.ScreenedPieces`); a store with
        ``kv_snapshot_pieces()`` is even read piece by piece. With a change
        feed, a snapshot asked for after the first one (a
        RESYNC: the *receiver* lost messages) is what was sent plus this
        poll's changes, not a new listing: ``sent`` is what the store held at
        the last poll. A trainer stopped for seconds then costs the store
        nothing and converges in the time to send the keys (1M SQLite keys:
        a listing ~5 s, the snapshot from ``sent`` ~1 s).

        Raises:
            Exception: whatever the source raised, or TypeError for a
                malformed answer (see :func:`diff_raw_listing`).
        """
        self._pending = None
        self.last_complete, self.last_deletes = True, {}
        if not self.feed:
            # Packed where the source can (poller.wire.sources.PackedItems): unchanged keys are not decoded.
            return _diffed(sent, self._listing(self._list), full, copy=False)
        due = (self.reconcile_interval is not None
               and time.monotonic() - self._listed_at >= self.reconcile_interval
               and self.duty.wait_for() == 0)
        if not due and self._cursor is not None:
            changes = self._source.kv_changes(self._cursor)
            if changes is not None:
                cursor, upserts, deletes = changes
                self._pending = (cursor, False)
                diff = diff_changes(sent, upserts, deletes, copy=False)
                self.last_complete, self.last_deletes = False, deletes or {}
                return _whole(sent, diff) if full else diff
            # Listed at once, within the share or not: a feed that lost its
            # cursor has nothing else to offer, and this is rare.
            logger.info("the source cannot serve change cursor %r: taking a full listing", self._cursor)
        in_pieces = getattr(self._source, "kv_snapshot_pieces", None)
        if full and callable(in_pieces):
            # Read while it is sent: the store's parsing overlaps the trainer's apply.
            began = time.monotonic()
            try:
                cursor, pieces = in_pieces()
            except BaseException:
                self.duty.unanswered(time.monotonic())
                raise
            self._pending = (cursor, True)
            return RawSnapshot(self._timed(pieces, began), copy=False)
        cursor, listing = self._listing(self._source.kv_snapshot)
        self._pending = (cursor, True)
        return _diffed(sent, listing, full, copy=False)

    def _timed(self, pieces: Iterator[Any], began: float) -> Iterator[Any]:
        """``pieces``, the listing read in pieces, timed into the duty cycle once read whole (else unanswered)."""
        whole = False
        try:
            yield from pieces
            whole = True
        finally:
            close = getattr(pieces, "close", None)
            if callable(close):
                close()
            if whole:
                self.duty.record(began, time.monotonic() - began)
            else:
                self.duty.unanswered(time.monotonic())

    def _listing(self, call: Callable[[], _T]) -> _T:
        """``call()``, a full listing, timed into the duty cycle if the store answered it within ``stall_timeout``.

        A call that raised (failed, or gave up at its own deadline) or
        answered only past ``stall_timeout`` is unanswered: the store did not
        answer in time, and the time is not counted as time it spent listing.
        """
        began = time.monotonic()
        try:
            listing = call()
        except BaseException:
            self.duty.unanswered(time.monotonic())
            raise
        ended = time.monotonic()
        if self.stall_timeout is not None and ended - began >= self.stall_timeout:
            self.duty.unanswered(ended)
        else:
            self.duty.record(began, ended - began)
        return listing

    def include(self, partition_ids: frozenset[str]) -> None:
        """List these partitions too from now on, when the source lists a chosen set of them.

        Calls the source's optional ``include_partitions(ids)``; a source
        without it lists every partition already, these included.
        """
        include = getattr(self._source, "include_partitions", None)
        if callable(include):
            include(sorted(partition_ids))

    def commit(self) -> None:
        """The diff :meth:`read` returned was sent: continue from its cursor."""
        if self._pending is None:
            return
        cursor, listed = self._pending
        self._pending = None
        self._cursor = cursor
        if listed:
            self._listed_at = time.monotonic()

