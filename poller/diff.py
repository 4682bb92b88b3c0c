"""One poll against what was sent: compared, screened and packed, as the poller sends it.

Runs on the poller's polling thread (:mod:`poller.polling`). :class:`Diff` is one poll against ``sent`` (each key's
tags as the bytes sent): a listed key changed when its tags, packed (by the source where it can,
:class:`~poller.sources.contract.PackedItems`, so an unchanged key is not even decoded), are not those bytes:
decided once, here, in C-level passes. Only changed tags are screened (:func:`poller.wire.tags.screen`); what the
wire cannot carry is :attr:`Diff.refused` (:mod:`poller.quarantine`). What is sent is kept packed, nothing the
source owns (1M keys: ~200 MB, not ~670). The source is read for the poll by :mod:`poller.reader`.
"""

from __future__ import annotations

from itertools import compress, filterfalse, repeat
from operator import eq, ne, not_
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

from poller.sources.contract import PackedItems
from poller.wire.protocol import Limits, Piece
from poller.wire.tags import DICT_ONLY, STR_ONLY, Refused, fresh_strs, pack_many_tags, screen
from poller.wire.vocabulary import UnreadableValue

__all__ = ["Diff", "Sent"]

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
