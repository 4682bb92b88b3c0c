"""What the poller sends: the source read, compared with what was sent, screened, packed, and what is held back.

Runs on the poller's polling thread (:mod:`poller.polling`), in three parts:

- :class:`Diff`, one poll against ``sent`` (each key's tags as the bytes sent): a listed key changed when its tags,
  packed (by the source where it can, :class:`~poller.sources.contract.PackedItems`, so an unchanged key is not even
  decoded), are not those bytes: decided once, here, in C-level passes. Only changed tags are screened
  (:func:`poller.wire.tags.screen`). What is sent is kept packed, nothing the source owns (1M keys: ~200 MB, not ~670).
- :class:`ListingReader`, the source read for one poll: by its change feed when it has one (the SQLite store),
  listed in full only for a snapshot, when the feed cannot serve the cursor, and every :data:`RECONCILE_INTERVAL`
  (a safety net for what a feed could miss: triggers dropped, a deletion log trimmed by hand); 100k keys: a listing
  ~390 ms, a change read ~1 ms. Every full listing is timed into the listing share
  (:class:`~poller.duty.ListingDuty`); one that fails or runs past ``stall_timeout`` is unanswered.
- :class:`Quarantine`, the keys the wire cannot carry: left out of the stream (deleted from the receiver if sent),
  named in a rate-limited WARNING and counted in heartbeats while every other key flows; a key comes back once
  its tags are valid, and leaves once deleted.
"""

from __future__ import annotations

import logging
import time
from itertools import compress, filterfalse, repeat
from operator import eq, ne, not_
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

from poller.common.checks import DEFAULT_LISTING_SHARE
from poller.duty import ListingDuty
from poller.sources.contract import PackedItems, Source, capabilities
from poller.wire.protocol import Limits, Piece
from poller.wire.tags import DICT_ONLY, STR_ONLY, Refused, fresh_strs, pack_many_tags, screen
from poller.wire.vocabulary import UnreadableValue

__all__ = ["Diff", "Sent", "ListingReader", "RECONCILE_INTERVAL", "Quarantine", "display_name", "MAX_REPORTED"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: What the receiver holds of this poller: ``{partition: {key: packed tags}}``.
Sent = dict[str, dict[str, bytes]]

_UNSENT = object()  # equal to nothing: a listed key never sent


class Diff:
    """One poll against ``sent``: iterating yields its pieces, each made only when the one before was sent.

    ``listings``: one listing, or a snapshot read in pieces, each ``{partition: {key: tags} | PackedItems}``
    (``None``: nothing stored). ``full``: every listed key is sent (an unchanged one as the bytes sent) and nothing
    is deleted: the receiver works out what vanished. ``complete=False``: a change set, whose ``deletes`` are given.
    ``held``: a snapshot of what is held, sent as it is. What the stream cannot carry is :attr:`refused`, never an
    error of the poll (and unless ``full`` deleted if it was sent). Once iterated, :attr:`deletes` is whole and
    :meth:`commit` makes ``sent`` what the receiver holds.

    Raises:
        TypeError: (building it) change-set deletes that are not ``{partition: [key, ...]}``;
            (iterating) a listing that is not a mapping: the source's answer, not one record, is wrong.
    """

    def __init__(self, listings: Iterable[Any], sent: Sent, *, full: bool, limits: Limits, size: int,
                 complete: bool = True, deletes: Any = None, held: Sent | None = None) -> None:
        self._listings = listings
        self._sent = sent
        self.full = full
        #: A complete listing (every key the store holds), or a change set and the deletes it gave.
        self.complete = complete
        self._limits = limits
        self._size = size
        self._held = held
        self.gone = _checked_deletes(deletes)
        self._listed: dict[str, Mapping[Any, Any]] = {}
        self.refused: list[Refused] = []
        self.deletes: dict[str, list[str]] = {}
        #: What was sent, ``{partition: (keys, packed tags)}``, complete once iterated.
        self.packed: Piece = {}

    def close(self) -> None:
        """Close the store's iterator (its read transaction) if it was not read to the end."""
        close = getattr(self._listings, "close", None)
        if callable(close):
            close()

    def __iter__(self) -> Iterator[Piece]:
        if self._held is not None:
            for partition, items in self._held.items():
                if items:
                    yield self._sending(partition, list(items), list(items.values()))
            return
        for listing in self._listings:
            if listing is None:
                continue
            if not isinstance(listing, Mapping):
                raise TypeError(f"the source listed a {type(listing).__name__}, expected a mapping of partitions")
            for partition, items in listing.items():
                yield from self._partition(partition, items)
            if not isinstance(self._listings, (list, tuple)):
                yield {}  # a piece the store read: sent now, while the next is read
        if self.complete and not self.full:
            for partition, held in self._sent.items():
                if held and partition not in self._listed:
                    self.deletes[partition] = list(held)
        for partition, keys in self.gone.items():
            sent = self._sent.get(partition) if isinstance(partition, str) else None
            if sent:
                listed = self._listed.get(partition, {})
                gone = [key for key in keys if isinstance(key, str) and key in sent and key not in listed]
                if gone:
                    self.deletes.setdefault(partition, []).extend(gone)

    def commit(self, sent: Sent) -> None:
        """Make ``sent`` what the receiver holds once this poll is applied (a full one's keys as fresh objects)."""
        if self.full:
            sent.clear()
            sent.update({partition: dict(zip(fresh_strs(keys), blobs)) for partition, (keys, blobs)
                         in self.packed.items()})
            return
        for partition, (keys, blobs) in self.packed.items():
            sent.setdefault(partition, {}).update(zip(keys, blobs))
        for partition, keys in self.deletes.items():
            held = sent.get(partition)
            if held is not None:
                for key in keys:
                    held.pop(key, None)
                if not held:
                    del sent[partition]

    def _partition(self, partition: Any, items: Any) -> Iterator[Piece]:
        decode = None
        if type(items) is PackedItems:  # kv_list_packed(): decoded only where the bytes differ from those sent
            decode, items = items.decode, items.items
        if items is None:
            return
        if not isinstance(items, Mapping):
            self.refused.append(Refused(partition, "*", f"the partition's entry is {type(items).__name__}, "
                                                        f"not a mapping of keys"))
            return
        if not isinstance(partition, str):
            why = f"partition id {partition!r} is {type(partition).__name__}, not str"
            self.refused.extend(Refused(partition, key, why) for key in items)
            return
        if items:
            self._listed[partition] = items
        held = self._sent.get(partition) or {}
        keys, values = list(items), list(items.values())
        matched = 0
        for start in range(0, len(keys), self._size):
            end = start + self._size
            send_keys, blobs, matches = self._changed(partition, held, keys[start:end], values[start:end], decode)
            matched += matches
            if send_keys:
                yield self._sending(partition, send_keys, blobs)
        if self.complete and not self.full and matched < len(held):
            gone = list(filterfalse(items.__contains__, held))
            if gone:
                self.deletes[partition] = gone + self.deletes.get(partition, [])

    def _sending(self, partition: str, keys: list[str], blobs: list[bytes]) -> Piece:
        sent_keys, sent_blobs = self.packed.setdefault(partition, ([], []))
        sent_keys.extend(keys)
        sent_blobs.extend(blobs)
        return {partition: (keys, blobs)}

    def _changed(self, partition: str, held: Mapping[str, bytes], keys: list[Any], values: list[Any],
                 decode: Callable[[list[bytes]], list[Any]] | None) -> tuple[list[str], list[bytes], int]:
        """A slice of a partition (``values``: tags, or packed for ``decode``): keys to send, their bytes, keys sent."""
        helds: list[Any] = list(map(held.get, keys, repeat(_UNSENT))) if held else [_UNSENT] * len(keys)
        blobs: list[Any] = values if decode is not None else pack_many_tags(values)
        same = list(map(eq, helds, blobs))
        matched = len(keys) - helds.count(_UNSENT)
        todo = list(compress(range(len(keys)), map(not_, same)))
        if not todo:  # nothing changed: a full poll sends the very bytes sent
            return (keys, helds, matched) if self.full else ([], [], matched)
        todo_keys = [keys[i] for i in todo]
        todo_blobs = [blobs[i] for i in todo]
        tags = decode(todo_blobs) if decode is not None else [values[i] for i in todo]
        before = len(self.refused)
        plain = set(map(type, todo_keys)) <= STR_ONLY and set(map(type, tags)) <= DICT_ONLY
        if plain:
            changed = dict(zip(todo_keys, tags))  # the usual case (a first listing: every key), in C
        else:
            changed = {}
            for key, one in zip(todo_keys, tags):
                if not isinstance(key, str):
                    self.refused.append(Refused(partition, key, f"key is {type(key).__name__}, not str"))
                elif one is None:
                    changed[key] = {}
                elif isinstance(one, Mapping):
                    changed[key] = one
                else:
                    self.refused.append(Refused(partition, key, f"its tags could not be read: {one.reason}"
                                                if isinstance(one, UnreadableValue)
                                                else f"tags are {type(one).__name__}, not a mapping"))
        touched = screen(partition, changed, self.refused, self._limits)
        if plain and decode is None and not touched and None not in todo_blobs:
            send_keys, send_blobs = todo_keys, todo_blobs  # packed once already: it differs from what was sent
        else:  # converted by the screen or packed by another encoder: not sent again if those are the bytes sent
            send_keys, send_blobs = list(changed), pack_many_tags(changed.values())
            if held and not self.full:
                fresh = list(map(ne, map(held.get, send_keys), send_blobs))
                send_keys, send_blobs = list(compress(send_keys, fresh)), list(compress(send_blobs, fresh))
        if not self.full:
            dropped = [r.key for r in self.refused[before:] if r.key in held]
            if dropped:
                self.deletes.setdefault(partition, []).extend(dropped)
            return send_keys, send_blobs, matched
        if len(todo) == len(keys) and len(send_keys) == len(keys):
            return send_keys, send_blobs, matched  # every key sent anew (a first snapshot)
        # A full poll sends the keys unchanged too, as the very bytes sent, all in the listing's order.
        keep, merged = same, helds
        where = dict(zip(todo_keys, todo))
        for key, blob in zip(send_keys, send_blobs):
            keep[where[key]] = True
            merged[where[key]] = blob
        return list(compress(keys, keep)), list(compress(merged, keep)), matched


def _checked_deletes(deletes: Any) -> Mapping[Any, Any]:
    """A change set's deletes, checked to be ``{partition: [key, ...]}`` (a key need not be a ``str``)."""
    if deletes is None:
        return {}
    if not isinstance(deletes, Mapping):
        raise TypeError(f"kv_changes() deletes are {type(deletes).__name__}, expected a mapping of partitions")
    for partition, keys in deletes.items():
        if isinstance(keys, (str, bytes, Mapping)) or not hasattr(keys, "__iter__"):
            raise TypeError(f"kv_changes() deletes[{partition!r}] is {type(keys).__name__}, expected a list of keys")
    return deletes


# -- reading the source for one poll ---------------------------------------------------------------------------------

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
            changes = self.offered.kv_changes(self._cursor)  # type: ignore[misc]  # a feed has it
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
        cursor, listing = self._listing(self.offered.kv_snapshot)  # type: ignore[arg-type]  # a feed has it
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


# -- the quarantine: what was held back ------------------------------------------------------------------------------

#: How many quarantined keys a heartbeat names (the count is always whole).
MAX_REPORTED = 32
# Each name and reason is cut to this many characters in a report.
_NAME_CHARS = 200


def display_name(name: Any) -> str:
    """A name as it is reported: a ``str`` as it is, anything else as ``repr (type)``."""
    return name if isinstance(name, str) else f"{name!r} ({type(name).__name__})"


class Quarantine:
    """What the poller left out of the stream, for its heartbeats and its log.

    :meth:`replace` after a complete listing, :meth:`update` after a change set. Keys are held as the source named
    them (a non-``str`` too, so that its delete finds it).
    """

    def __init__(self, *, warnings_per_minute: int = 20) -> None:
        self.keys: dict[tuple[Any, Any], str] = {}
        self._budget = warnings_per_minute
        self._window: tuple[float, int] = (time.monotonic(), 0)
        self.changes = 0  # bumped whenever the set changes, so the poller reports at once
        self.ignored_deletes = 0  # deletes of names no stream carries, never quarantined (see update)

    def replace(self, refused: Iterable[Refused]) -> None:
        now = {(r.partition, r.key): r.reason for r in refused}
        entered = [(pk, reason) for pk, reason in now.items() if self.keys.get(pk) != reason]
        left = [pk for pk in self.keys if pk not in now]
        self.keys = now
        self._report(entered, left)

    def update(self, refused: Iterable[Refused], sent: Piece, deleted: Mapping[Any, Iterable[Any]]) -> None:
        """Refused keys join; keys ``sent`` (:attr:`Diff.packed`) or deleted leave.

        ``deleted``: the change set's deletes as the source gave them. A delete of a name no stream carries (not a
        ``str``) lets the record go if it was quarantined, else is counted (:attr:`ignored_deletes`).
        """
        entered = []
        for r in refused:
            pk = (r.partition, r.key)
            if self.keys.get(pk) != r.reason:
                self.keys[pk] = r.reason
                entered.append((pk, r.reason))
        left: dict[tuple[Any, Any], None] = {}
        ignored: list[tuple[Any, Any]] = []
        for partition, keys in deleted.items():
            if isinstance(partition, str) and set(map(type, keys)) <= STR_ONLY:  # the usual case, in one C-level pass
                if self.keys:
                    left.update(dict.fromkeys(pk for pk in zip(repeat(partition), keys) if pk in self.keys))
                continue
            for key in keys:
                pk = (partition, key)
                try:
                    held = pk in self.keys
                except TypeError:  # unhashable: no quarantined name equals it
                    held = False
                if held:
                    left[pk] = None
                elif not (isinstance(partition, str) and isinstance(key, str)):
                    ignored.append(pk)
        if self.keys:
            left.update(dict.fromkeys(pk for partition, (keys, _) in sent.items()
                                      for pk in zip(repeat(partition), keys) if pk in self.keys))
        for pk in left:
            del self.keys[pk]
        self._report(entered, list(left), ignored)

    def names(self, limit: int = MAX_REPORTED) -> list[list[str]]:
        """Up to ``limit`` ``[partition, key, reason]``, each cut to a bounded length."""
        return [[display_name(partition)[:_NAME_CHARS], display_name(key)[:_NAME_CHARS], reason[:_NAME_CHARS]]
                for (partition, key), reason in list(self.keys.items())[:limit]]

    def _report(self, entered: list[tuple[tuple[Any, Any], str]], left: list[tuple[Any, Any]],
                ignored: Sequence[tuple[Any, Any]] = ()) -> None:
        if ignored:
            self.ignored_deletes += len(ignored)
            # Not a change of the quarantine: logged (within the budget), not reported in a heartbeat.
            partition, key = ignored[0]
            self._log(logging.INFO, "ignored %d delete(s) of keys no stream carries (first: %s/%s; %d in all "
                      "since the poller started): they were never streamed", len(ignored),
                      display_name(partition), display_name(key), self.ignored_deletes)
        if not entered and not left:
            return
        self.changes += 1
        shown = entered[:max(0, min(5, self._left_in_budget()))]
        for (partition, key), reason in shown:
            self._log(logging.WARNING, "quarantined %s/%s: %s; the key is left out of the stream until its tags "
                      "are valid (every other key keeps flowing)", display_name(partition), display_name(key),
                      reason)
        if len(entered) > len(shown):
            self._log(logging.WARNING, "quarantined %d more key(s) (%d in all; see stats()['quarantined_keys'])",
                      len(entered) - len(shown), len(self.keys))
        if left:
            logger.info("%d key(s) left the quarantine (valid again or cleared); %d remain", len(left),
                        len(self.keys))

    def _left_in_budget(self) -> int:
        """Log lines this minute's budget still allows."""
        if time.monotonic() - self._window[0] >= 60.0:
            self._window = (time.monotonic(), 0)
        return self._budget - self._window[1]

    def _log(self, level: int, message: str, *args: Any) -> None:
        """Log at ``level`` while this minute's budget lasts, then at DEBUG."""
        over = self._left_in_budget() <= 0
        logger.log(logging.DEBUG if over else level, message, *args)
        if not over:
            self._window = (self._window[0], self._window[1] + 1)
