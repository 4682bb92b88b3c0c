"""What the poller sends for a listing: check it, diff it against what was sent, screen the diff.

Pure functions, no threads and no sockets: :class:`~poller.polling.PollingThread`
calls them on every poll (then :func:`poller.deltas.iter_encode_pieces`
encodes the diff), and tests call them directly.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import and_, eq, is_not, not_
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

from poller.quarantine import Refused
from poller.wire.sources import PackedItems, UnreadableValue
from poller.wire.tags import fresh_strs, pack_many_tags, pack_tags
from poller.wire.vocabulary import Listing, Tags

__all__ = ["Listing", "ListingDiff", "RawSnapshot", "diff_raw_listing", "commit_listing"]



def checked_listing(raw: Any) -> Mapping[Any, Any]:
    """``raw``, a ``kv_list()`` answer, as a mapping (``None``: nothing stored).

    Raises:
        TypeError: ``raw`` is not a mapping: a garbage answer, a source error.
    """
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise TypeError(f"kv_list() returned {type(raw).__name__}, expected a mapping of partitions")
    return raw


def diff_raw_listing(sent: Listing, raw: Any, full: bool, complete: bool = True, copy: bool = True) -> "ListingDiff":
    """Check a ``kv_list()`` result and diff it against ``sent``, in one pass over ``raw``.

    The diff holds the keys whose tags changed since ``sent`` (as fresh
    dicts; ``None`` tags are ``{}``) and, unless ``full``, the keys that
    vanished. With ``full`` every listed key is an upsert and nothing is a
    delete: the receiver works out what vanished from the snapshot itself,
    because after a restart this side no longer knows what it had sent.
    ``raw=None`` means nothing is stored. ``complete=False`` (a change set,
    not a listing): nothing is a delete, keys absent from ``raw`` are kept.
    ``copy=False``: the diff may hold the source's own tag dicts, for a
    caller that keeps none of them (a change feed's poller keeps bytes).

    A key that is not a ``str``, in a partition whose id is not a ``str``
    or whose entry is not a mapping, or whose tags are not a mapping (an
    :class:`~poller.wire.sources.UnreadableValue` where the source could not
    read them) is *refused* (``diff.refused``), not an error: one bad record must not
    fail the listing (:mod:`poller.quarantine`).
    A refused key that ``sent`` holds is deleted unless ``full``.

    Only changed tags are copied; an unchanged key costs one lookup and one
    comparison, both in C-level passes over the partition, and nothing is
    built for it unless ``full``. ``sent`` is not modified;
    :func:`commit_listing` applies the diff once it was encoded.

    Raises:
        TypeError: ``raw`` is not a mapping: a garbage answer, a source error.
    """
    raw = checked_listing(raw)
    upserts: dict[str, dict[str, Tags]] = {}
    deletes: dict[str, list[str]] = {}
    refused: list[Refused] = []
    fresh: dict[str, list[str]] = {}
    listed: set[str] = set()
    for partition, items in raw.items():
        if items is None:
            continue
        decode = None
        if type(items) is PackedItems:  # kv_list_packed(): decoded below only where they differ from what was sent
            decode = items.decode
            items = items.items
        if not isinstance(items, Mapping):
            refused.append(Refused(partition, "*", f"the partition's entry is {type(items).__name__}, "
                                                   f"not a mapping of keys"))
            continue
        if not isinstance(partition, str):
            why = f"partition id {partition!r} is {type(partition).__name__}, not str"
            refused.extend(Refused(partition, key, why) for key in items)
            continue
        previous = sent.get(partition, {})
        changed, dropped, matched = _diff_items(previous, partition, list(items), list(items.values()), full, copy,
                                                refused, fresh, decode)
        if items:
            listed.add(partition)
        if changed:
            upserts[partition] = changed
        gone = [key for key in previous if key not in items] if complete and not full and matched < len(previous) \
            else []
        if not full and (gone or dropped):
            deletes[partition] = gone + dropped
    if complete and not full:
        for partition, previous in sent.items():
            if partition not in listed and previous:
                deletes[partition] = list(previous)
    return ListingDiff(upserts, deletes, refused, fresh if full else None)


def _diff_items(previous: Mapping[str, Any], partition: str, keys: list[Any], values: list[Any], full: bool,
                copy: bool, refused: list[Refused], fresh: dict[str, list[str]],
                decode: Callable[[list[bytes]], list[Any]] | None = None) -> tuple[dict[str, Tags], list[str], int]:
    """One partition's listed ``keys`` and their tags against what was sent of it (``previous``).

    Returns the upserts, the keys held before and now refused (to delete)
    and how many listed keys were held before. Refusals join ``refused``; in
    a ``full`` diff, ``fresh[partition]`` gets the upserted keys whose tags
    are not ``previous``'s own objects. With ``decode``, ``values`` are
    packed tags (:class:`~poller.wire.sources.PackedItems`).
    """
    helds: list[Any] = list(map(previous.get, keys)) if previous else [None] * len(keys)
    if decode is None:
        same = _same(helds, values)
    else:
        values, same = _same_packed(helds, values, decode)
    matched = len(helds) - helds.count(None)
    # Unchanged keys keep the very objects sent (the screen skips those).
    changed: dict[str, Tags] = dict(compress(zip(keys, helds), same)) if full else {}
    dropped: list[str] = []
    todo = list(compress(range(len(keys)), map(not_, same)))
    new_keys = [keys[i] for i in todo]
    new_tags = [values[i] for i in todo]
    if set(map(type, new_keys)) <= _STR and set(map(type, new_tags)) <= _DICT:
        # The usual case (a first listing: every key): copied in one C-level pass.
        changed.update(zip(new_keys, map(dict, new_tags) if copy else new_tags))
        if full and new_keys:
            fresh.setdefault(partition, []).extend(new_keys)
        return changed, dropped, matched
    for i in todo:
        key, tags, held = keys[i], values[i], helds[i]
        if not isinstance(key, str):
            refused.append(Refused(partition, key, f"key is {type(key).__name__}, not str"))
            continue
        if tags is None:
            tags = {}
        if type(tags) is not dict and not isinstance(tags, Mapping):
            why = (f"its tags could not be read: {tags.reason}" if isinstance(tags, UnreadableValue)
                   else f"tags are {type(tags).__name__}, not a mapping")
            refused.append(Refused(partition, key, why))
            if held is not None:
                dropped.append(key)
            continue
        changed[key] = dict(tags) if copy or type(tags) is not dict else tags
    if full:
        fresh.setdefault(partition, []).extend(key for key in new_keys if isinstance(key, str) and key in changed)
    return changed, dropped, matched


class RawSnapshot(NamedTuple):
    """A full listing not diffed yet: :class:`~poller.pieces.ScreenedPieces` diffs it piece by piece as it sends it.

    ``raw`` is the listing, checked to be a mapping, or an iterator of
    listings to take one after the other (a store read in pieces:
    ``kv_snapshot_pieces()``), which :meth:`close` closes. ``copy`` as for
    :func:`diff_raw_listing`.
    """

    raw: Mapping[Any, Any] | Iterator[Any]
    copy: bool = True

    def diff(self, sent: Listing) -> "ListingDiff":
        """The whole diff against ``sent`` at once (:func:`diff_raw_listing` with ``full``)."""
        if isinstance(self.raw, Mapping):
            return diff_raw_listing(sent, self.raw, True, copy=self.copy)
        listing: dict[Any, Any] = {}
        try:
            for piece in self._listings():
                for partition, items in piece.items():
                    if type(items) is PackedItems:
                        items = items.decoded()
                    if isinstance(items, Mapping) and isinstance(listing.get(partition), dict):
                        listing[partition].update(items)
                    else:
                        listing[partition] = dict(items) if isinstance(items, Mapping) else items
        finally:
            self.close()
        return diff_raw_listing(sent, listing, True, copy=self.copy)

    def close(self) -> None:
        """Close the store's iterator (its read transaction) if it was not read to the end."""
        close = getattr(self.raw, "close", None)
        if not isinstance(self.raw, Mapping) and callable(close):
            close()

    def _listings(self) -> Iterator[Mapping[Any, Any]]:
        if isinstance(self.raw, Mapping):
            yield self.raw
            return
        for piece in self.raw:
            if not isinstance(piece, Mapping):
                raise TypeError(f"a snapshot piece is {type(piece).__name__}, expected a mapping of partitions")
            yield piece

    def pieces(self, sent: Listing, size: int) -> Iterator["ListingDiff"]:
        """The diff against ``sent`` of each piece of at most ``size`` listed keys of one partition, in turn."""
        for listing in self._listings():
            for partition, items in listing.items():
                decode = None
                if type(items) is PackedItems and isinstance(partition, str):
                    decode = items.decode
                    items = items.items
                if not isinstance(partition, str) or not isinstance(items, Mapping):
                    yield diff_raw_listing(sent, {partition: items}, True, copy=self.copy)  # refused, and why
                    continue
                previous = sent.get(partition, {})
                keys = list(items)
                values = list(items.values())
                for start in range(0, len(keys), size):
                    refused: list[Refused] = []
                    fresh: dict[str, list[str]] = {}
                    changed, _, _ = _diff_items(previous, partition, keys[start:start + size],
                                                values[start:start + size], True, self.copy, refused, fresh, decode)
                    yield ListingDiff({partition: changed}, {}, refused, fresh)


def commit_listing(sent: Listing, diff: "ListingDiff", full: bool,
                   packed: Mapping[str, tuple[Sequence[str], Sequence[bytes]]] | None = None) -> None:
    """Make ``sent`` what the receiver holds once ``diff`` is applied.

    With ``packed`` (the diff's upserts as :class:`~poller.pieces.ScreenedPieces` packed them
    for the wire: ``{partition: (keys, packed tags)}``), ``sent`` keeps each
    key's packed tags instead of its tags: a poller reading a change feed,
    which compares only the keys a change set names (and a listing every 10
    minutes), so the bytes cost it nothing per poll and a million keys take
    ~200 MB instead of ~670 MB. A full listing's keys are then stored as
    fresh objects (:func:`~poller.tags.fresh_strs`). Without it, a full
    diff's own partition dicts become ``sent``'s.
    """
    held_by: dict[str, dict[str, Any]] = sent  # tags, or (a change feed's poller) packed tags
    if full:
        sent.clear()
        if packed is None:
            sent.update({partition: items for partition, items in diff.upserts.items() if items})
        else:
            held_by.update({partition: dict(zip(fresh_strs(keys), blobs))
                            for partition, (keys, blobs) in packed.items()})
        return
    if packed is None:
        for partition, items in diff.upserts.items():
            if items:
                sent.setdefault(partition, {}).update(items)
    else:
        for partition, (keys, blobs) in packed.items():
            held_by.setdefault(partition, {}).update(zip(keys, blobs))
    for partition, keys in diff.deletes.items():
        held = sent.get(partition)
        if held is not None:
            for key in keys:
                held.pop(key, None)
            if not held:
                del sent[partition]


_STR = frozenset({str})
_DICT = frozenset({dict})
_BYTES_OR_NONE = frozenset({bytes, type(None)})


def _same(helds: list[Any], values: list[Any]) -> list[bool]:
    """Whether each listed tags equal what was sent (``None``: never sent), compared in C where it can be.

    Tag dicts compare in one C-level pass (K=100k: ~30 ms of a ~90 ms diff
    was the Python loop around the comparison). Kept packed, or holding a
    value whose ``==`` is not a plain bool (an array), they are compared one
    by one, and such a value counts as changed.
    """
    if helds.count(None) == len(helds):
        return [False] * len(helds)
    kinds = set(map(type, helds))
    if bytes not in kinds:
        try:
            # A key never sent is changed, even listed as None (None == None).
            return list(map(and_, map(is_not, helds, repeat(None)), map(bool, map(eq, helds, values))))
        except Exception:  # an array's ==, somewhere: one by one below
            pass
    elif kinds <= _BYTES_OR_NONE and set(map(type, values)) <= _DICT:
        try:
            # Kept packed: each listing packed in one C-level pass, compared as bytes
            # (K=100k: ~45 ms a poll, where comparing dicts took ~35 ms).
            return list(map(eq, helds, pack_many_tags(values)))
        except Exception:  # a value msgpack cannot pack (it needs the screen): one by one below
            pass
    return [_same_one(held, tags) for held, tags in zip(helds, values)]


def _same_packed(helds: list[Any], blobs: list[bytes],
                 decode: Callable[[list[bytes]], list[Any]]) -> tuple[list[Any], list[bool]]:
    """Listed packed tags against what was sent: ``(values, same)``, decoding only the keys whose bytes differ.

    Bytes equal to those sent are the same tags (K=100k: walking a reply
    and comparing its bytes ~27 ms, where decoding it and packing every
    key's tags to compare took ~116 ms). Bytes that differ are decoded and
    compared as tags (:func:`_same`): packed by another encoder, or with
    an extension type, equal tags still come out the same. ``values`` holds
    the decoded tags where ``same`` is False, the packed bytes elsewhere.
    """
    same = list(map(eq, helds, blobs))  # a held dict or None never equals bytes
    differ = list(compress(range(len(blobs)), map(not_, same)))
    if not differ:
        return blobs, same
    decoded = decode([blobs[i] for i in differ])
    values = list(blobs)
    for i, tags, unchanged in zip(differ, decoded, _same([helds[i] for i in differ], decoded)):
        values[i] = tags
        same[i] = unchanged
    return values, same


def _same_one(held: Any, tags: Any) -> bool:
    if held is None:
        return False
    try:
        # held was screened when it was sent; kept packed, it is compared packed.
        return bool(held == tags) if type(held) is not bytes else held == _packed(tags)
    except Exception:  # a value whose == is not a bool (an array): changed
        return False


def _packed(tags: Any) -> bytes | None:
    """``tags`` as :func:`~poller.tags.pack_upserts` packs them; None if they need the screen first."""
    return pack_tags(tags) if type(tags) is dict else None


class ListingDiff(NamedTuple):
    """What changed between the last listing sent and the current one, and the keys refused.

    ``fresh``, in a full diff: per partition, the upserted keys whose tags
    are not the objects ``sent`` holds (``None``: not known).
    """

    upserts: dict[str, dict[str, Tags]]
    deletes: dict[str, list[str]]
    refused: Sequence[Refused] = ()
    fresh: Mapping[str, list[str]] | None = None

    def item_count(self) -> int:
        return sum(map(len, self.upserts.values())) + sum(map(len, self.deletes.values()))
