"""What one poll sends: its diff screened, packed and encoded piece by piece.

:class:`~poller.polling.PollingThread` hands each poll's diff (or a full
listing not diffed yet, :class:`~poller.listing.RawSnapshot`) to
:class:`ScreenedPieces` and encodes what it yields with
:func:`poller.deltas.iter_encode_pieces`, sending each body before the
next piece is made. The screen is :mod:`poller.quarantine`'s: a key the
receiver would refuse is left out (quarantined), never sent.
"""

from __future__ import annotations

from itertools import compress
from operator import is_not, ne
from typing import Any, Iterator, Mapping

from poller.deltas import upsert_pieces
from poller.listing import Listing, ListingDiff, RawSnapshot
from poller.quarantine import Refused, screen
from poller.wire.protocol import Limits
from poller.wire.tags import pack_upserts
from poller.wire.vocabulary import Tags

__all__ = ["ScreenedPieces", "screen_diff"]


def screen_diff(diff: "ListingDiff", sent: Listing, full: bool, limits: Limits) -> "ListingDiff":
    """``diff`` screened for what the receiver would refuse (:func:`poller.quarantine.screen`), whole.

    Its upserts are converted or refused in place; refused keys join
    ``refused``, and unless ``full`` those ``sent`` holds are deleted, so
    the receiver does not keep tags the store no longer has. A poll screens
    its diff piece by piece instead (:class:`ScreenedPieces`), by the same rules.
    """
    refused = list(diff.refused)
    _screen_piece(diff.upserts, diff.deletes, sent, full, refused, limits)
    return diff._replace(refused=refused)


class ScreenedPieces:
    """What one poll sends, screened and packed piece by piece, each piece sent before the next is made.

    Iterating yields pieces of at most ``size`` keys, ``{partition: {key:
    packed tags}}``, each screened (:func:`screen_diff`'s rules) just
    before it is yielded: the receiver applies one piece while the next is
    screened and packed, instead of waiting for the whole poll (1M keys:
    ~1.5 s of the poller's work before the first body). Given a
    :class:`RawSnapshot`, each piece is also diffed only when it is needed.
    Refusals join :attr:`refused`, and their deletes :attr:`deletes`, as the
    pieces go, so the deletes are complete once the pieces are. A key whose
    tags pack to the bytes ``sent`` holds is not sent again (tags the screen
    converted, listed unchanged).

    Once iterated to the end, :attr:`packed` holds the upserts sent,
    ``{partition: (keys, packed tags)}``, and :attr:`diff` the deletes and
    refusals: both for :func:`commit_listing`.
    """

    def __init__(self, given: "ListingDiff | RawSnapshot", sent: Listing, full: bool, limits: Limits,
                 size: int) -> None:
        self._given = given
        self._sent = sent
        self._full = full
        self._limits = limits
        self._size = size
        self.refused: list[Refused] = list(given.refused) if isinstance(given, ListingDiff) else []
        self.deletes: dict[str, list[str]] = given.deletes if isinstance(given, ListingDiff) else {}
        self.packed: dict[str, tuple[list[str], list[bytes]]] = {}

    @property
    def diff(self) -> "ListingDiff":
        """The deletes and refusals sent (the upserts are :attr:`packed`)."""
        return ListingDiff({}, self.deletes, self.refused)

    def keys_sent(self) -> dict[str, list[str]]:
        """The keys upserted, per partition."""
        return {partition: keys for partition, (keys, _) in self.packed.items()}

    def _diffs(self) -> Iterator["ListingDiff"]:
        given = self._given
        if isinstance(given, RawSnapshot):
            yield from given.pieces(self._sent, self._size)
            return
        for piece in upsert_pieces(given.upserts, self._size):
            yield ListingDiff(piece, {}, ())  # the screen tells the fresh tags by identity

    def __iter__(self) -> Iterator[dict[str, dict[str, bytes]]]:
        for diff in self._diffs():
            piece = diff.upserts
            self.refused.extend(diff.refused)
            _screen_piece(piece, self.deletes, self._sent, self._full, self.refused, self._limits, diff.fresh)
            packed = {partition: items for partition, items in pack_upserts(piece).items() if items}
            if not self._full:
                packed = {partition: fresh for partition, items in packed.items()
                          if (fresh := _not_held(items, self._sent.get(partition)))}
            if not packed:
                continue  # every key of it refused, or held already
            for partition, items in packed.items():
                keys, blobs = self.packed.setdefault(partition, ([], []))
                keys.extend(items)
                blobs.extend(items.values())
            yield packed


def _not_held(items: dict[str, bytes], held: Mapping[str, Any] | None) -> dict[str, bytes]:
    """``items`` less those whose packed tags are the bytes ``held`` has for them already."""
    if not held:
        return items
    keys = list(items)
    blobs = list(items.values())
    fresh = list(map(ne, map(held.get, keys), blobs))
    return items if all(fresh) else dict(compress(zip(keys, blobs), fresh))


def _screen_piece(upserts: dict[str, dict[str, Tags]], deletes: dict[str, list[str]], sent: Listing, full: bool,
                  refused: list[Refused], limits: Limits, fresh: Mapping[str, list[str]] | None = None) -> None:
    """Screen ``upserts`` in place; refusals join ``refused`` and, unless ``full``, the deletes of keys sent.

    ``fresh`` (a full diff's :attr:`ListingDiff.fresh`) names the keys whose
    tags are not ``sent``'s own objects, the only ones a full diff screens.
    """
    before = len(refused)
    if full and sent:
        _screen_new(upserts, sent, refused, limits, fresh)
    else:
        screen(upserts, refused, limits)
    if full:
        return
    for refusal in refused[before:]:
        held = sent.get(refusal.partition)
        # A refused upsert is never also a vanished key (those were not listed): no duplicate delete.
        if held is not None and refusal.key in held:
            deletes.setdefault(refusal.partition, []).append(refusal.key)


def _screen_new(upserts: dict[str, dict[str, Tags]], sent: Listing, refused: list[Refused], limits: Limits,
                fresh_keys: Mapping[str, list[str]] | None) -> None:
    """:func:`screen` for a full diff: only the tags that are not the very objects ``sent`` holds.

    A full diff lists every key, and those unchanged since they were sent are
    ``sent``'s own dicts (or bytes), screened when first sent: a resync
    screens only what changed, named by the diff or found in C-level passes.
    """
    for partition, items in upserts.items():
        held = sent.get(partition)
        if held is None:
            screen({partition: items}, refused, limits)
            continue
        if fresh_keys is not None:
            fresh = {key: items[key] for key in fresh_keys.get(partition, ())}
        else:
            keys = list(items)
            values = list(items.values())
            fresh = {keys[i]: values[i]
                     for i in compress(range(len(keys)), map(is_not, map(held.get, keys), values))}
        if not fresh:
            continue
        before = len(refused)
        if screen({partition: fresh}, refused, limits):
            for refusal in refused[before:]:
                del items[refusal.key]
            items.update(fresh)
