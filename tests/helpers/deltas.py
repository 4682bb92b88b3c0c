"""One delta in tests: diffed as a poller diffs a listing (poller.diff), applied as the receiver applies it."""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

from buffer.store import PartitionStore
from poller.diff import Diff, Sent
from poller.faults.peer import packed_delta
from poller.reader import ListingReader
from poller.wire.protocol import DEFAULT_LIMITS, Delta, Limits, Piece
from poller.wire.tags import Refused, pack_tags, thaw_many, unpack_many_tags


def apply(store: PartitionStore, stream: str, upserts: dict[str, dict[str, Any]] | None = None,
          deletes: dict[str, list[str]] | None = None, *, epoch: int = 1, poll: int = 1, full: bool = False,
          reset: bool = False, end: bool = False, sync: int = 0) -> None:
    """``upserts`` (``{partition: {key: tags}}``, packed as a poller packs them) and ``deletes`` as one DELTA."""
    store.apply(stream, epoch, packed_delta(upserts or {}, deletes, poll=poll, full=full, reset=reset, end=end,
                                            sync=sync))


def apply_blobs(store: PartitionStore, stream: str, partition: str, keys: list[str], blobs: list[Any], *,
                epoch: int = 1, poll: int = 1) -> None:
    """One DELTA part of ``keys`` whose tags are ``blobs``, as they would arrive."""
    store.apply(stream, epoch, Delta(poll, 0.0, False, False, False, {partition: [keys, blobs]}, {}, 0))


# -- the poller's side: a listing diffed against what was sent, as a poll diffs it -------------------

class Polled(NamedTuple):
    """What a poll sends: its upserts as tags, its deletes and refusals, and the diff itself (to commit)."""

    upserts: dict[str, dict[str, Any]]
    deletes: dict[str, list[str]]
    refused: list[Refused]
    diff: Diff


def packed_sent(listing: dict[str, dict[str, Any]]) -> Sent:
    """What a poller holds once it sent ``listing``: each key's tags packed."""
    return {partition: {key: pack_tags(tags) for key, tags in items.items()} for partition, items in listing.items()}


def polled(sent: Sent, raw: Any, *, full: bool, limits: Limits = DEFAULT_LIMITS, size: int = 4096,
           complete: bool = True, deletes: Any = None) -> Polled:
    """``raw`` (a ``kv_list()`` answer, or with ``complete=False`` a change set) diffed against ``sent``."""
    diff = Diff([raw], sent, full=full, limits=limits, size=size, complete=complete, deletes=deletes)
    return Polled(sent_tags(diff), diff.deletes, diff.refused, diff)


def sent_tags(pieces: Iterable[Piece]) -> dict[str, dict[str, Any]]:
    """The tags of every piece, per partition (iterating a diff sends it)."""
    upserts: dict[str, dict[str, Any]] = {}
    for piece in pieces:
        for partition, (keys, blobs) in piece.items():
            upserts.setdefault(partition, {}).update(zip(keys, thaw_many(blobs)))
    return upserts


def pieces_of(upserts: dict[str, dict[str, Any]]) -> list[Piece]:
    """``{partition: {key: tags}}`` as one piece of packed tags per partition."""
    return [{partition: (list(items), [pack_tags(tags) for tags in items.values()])}  # type: ignore[misc]
            for partition, items in upserts.items()]


def delta_tags(delta: Delta, limits: Limits = DEFAULT_LIMITS) -> dict[str, dict[str, Any]]:
    """A decoded DELTA's upserts as tags, checked as the buffer unpacks them."""
    return {partition: dict(zip(keys, unpack_many_tags(blobs, limits))) for partition, (keys, blobs)
            in delta.packed.items()}


def read(reader: ListingReader, sent: Sent, full: bool, *, commit: bool = False) -> Polled:
    """One poll's read and diff as the polling thread takes them; with ``commit``, sent and committed."""
    diff = reader.read(sent, full, limits=DEFAULT_LIMITS, size=4096)
    got = Polled(sent_tags(diff), diff.deletes, diff.refused, diff)
    if commit:
        diff.commit(sent)
        reader.commit()
    return got


def held_tags(sent: Sent) -> dict[str, dict[str, Any]]:
    """What a poller holds as sent, as tags."""
    return {partition: dict(zip(items, thaw_many(list(items.values())))) for partition, items in sent.items()}
