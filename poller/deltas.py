"""DELTA bodies: a poll's changes encoded in bounded bodies, one at a time.

The encoding half of the wire for the one bulky kind (:mod:`poller.wire.protocol`
holds the rest, and decodes every kind). A DELTA's head is packed from its
record and its bulky fields once per piece of at most ``chunk_items`` keys,
each key's tags packed alone in ``packed``; a piece over the frame limit is
split in halves until each fits.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import msgpack

from poller.wire.errors import ProtocolError
from poller.wire.messages import DELTA_BULKY_FIELDS, Delta, Kind, as_map

__all__ = ["encode_delta", "iter_encode_delta", "iter_encode_pieces", "upsert_pieces"]










# -- DELTA bodies -------------------------------------------------------------------------------

# Upper bound of the head encode_delta puts before the payload.
_DELTA_HEAD_BYTES = 64


def encode_delta(head: Delta, payload: bytes) -> bytes:
    """A DELTA body: ``head``'s own fields (its bulky ones ignored) before ``payload``.

    ``payload`` is the bulky fields packed once (:func:`iter_encode_delta`
    sizes and splits on it); msgpack maps are a plain concatenation of
    key/value encodings, so the head is packed from the record in front.
    """
    packer = msgpack.Packer(use_bin_type=True)
    fields = {name: value for name, value in as_map(Kind.DELTA, head).items() if name not in DELTA_BULKY_FIELDS}
    fields["t"] = float(fields["t"])
    return packer.pack_map_header(len(fields) + len(DELTA_BULKY_FIELDS)) + b"".join(
        packer.pack(name) + packer.pack(value) for name, value in fields.items()) + payload


def _pack_items(upserts: Mapping[str, Mapping[str, Any]], deletes: Mapping[str, Any]) -> bytes:
    """The bulky fields of one DELTA body: every key's tags packed alone, in ``packed``.

    ``bytes`` tags were packed before (:func:`pack_upserts`) and go as they are.
    """
    try:
        packer = msgpack.Packer(use_bin_type=True)
        pack = packer.pack
        packed = {}
        for partition, items in upserts.items():
            blobs = list(items.values())
            if not set(map(type, blobs)) <= _BYTES:  # packed already, the usual case: no call per key
                blobs = [t if type(t) is bytes else pack(t) for t in blobs]
            packed[partition] = [list(items), blobs]
        return (packer.pack("upserts") + packer.pack({}) + packer.pack("packed") + packer.pack(packed)
                + packer.pack("deletes") + packer.pack(deletes))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode DELTA items: {exc}") from exc


_BYTES = frozenset({bytes})

Items = tuple[dict[str, dict[str, Any]], dict[str, list[str]]]  # (upserts, deletes)


def iter_encode_delta(upserts: dict[str, dict[str, Any]], deletes: dict[str, list[str]], *, poll: int,
                      started: float, full: bool, chunk_items: int, max_frame_bytes: int,
                      sync: int = 0) -> Iterator[bytes]:
    """A poll's changes as one or more DELTA bodies, each under the frame limit, one at a time.

    The first body of a full snapshot carries ``reset``; the last body of
    every poll carries ``end``, which tells the receiver the poll is complete.
    Each body can be sent while the next is packed, so the trainer decodes
    a snapshot while the poller still encodes it. A ProtocolError can come
    after some bodies were sent: the poll then has no ``end`` and is sent
    again, which the receiver tolerates (merges are idempotent, a new
    snapshot starts over). What is given must have been screened for the
    receiver's limits (:func:`poller.pieces.screen_diff`).

    Raises:
        ProtocolError: a value msgpack cannot encode, or one key whose tags
            alone exceed ``max_frame_bytes`` (neither passes the screen).
    """
    return iter_encode_pieces(upsert_pieces(upserts, chunk_items), deletes, poll=poll, started=started, full=full,
                              chunk_items=chunk_items, max_frame_bytes=max_frame_bytes, sync=sync)


def iter_encode_pieces(pieces: Iterable[dict[str, dict[str, Any]]], deletes: dict[str, list[str]], *, poll: int,
                       started: float, full: bool, chunk_items: int, max_frame_bytes: int,
                       sync: int = 0) -> Iterator[bytes]:
    """:func:`iter_encode_delta` of upserts given in pieces of at most ``chunk_items`` keys.

    Each piece is taken only when the body before it was handed on, so a
    caller can screen and pack a piece as it is needed
    (:class:`poller.pieces.ScreenedPieces`). ``deletes`` is read once the
    pieces are exhausted, and fills the last piece's body first.
    """
    head = Delta(poll=poll, t=started, full=full, reset=full, end=False, upserts={}, deletes={}, sync=sync)
    previous: bytes | None = None
    for payload in _payloads(_with_deletes(pieces, deletes, chunk_items), max_frame_bytes):
        if previous is not None:
            yield encode_delta(head, previous)
            head = head._replace(reset=False)
        previous = payload
    assert previous is not None  # _with_deletes yields at least one piece
    yield encode_delta(head._replace(end=True), previous)


def _count(items: Items) -> int:
    return sum(map(len, items[0].values())) + sum(map(len, items[1].values()))


def upsert_pieces(upserts: Mapping[str, Mapping[str, Any]], size: int) -> Iterator[dict[str, dict[str, Any]]]:
    """``upserts`` in pieces of at most ``size`` keys, each a new ``{partition: {key: tags}}``.

    A partition's entries are contiguous, so each piece holds at most one
    slice of each partition: slicing copies in C instead of key by key.
    """
    piece: dict[str, dict[str, Any]] = {}
    n = 0
    for partition, tags in upserts.items():
        # Keys and values apart, not a list of (key, tags) pairs: a million
        # pairs alive at once set off the garbage collector's full passes.
        keys = list(tags)
        values = list(tags.values())
        i = 0
        while i < len(keys):
            j = i + size - n
            piece[partition] = dict(zip(keys[i:j], values[i:j]))
            n += len(piece[partition])
            i = j
            if n >= size:
                yield piece
                piece, n = {}, 0
    if n:
        yield piece


def _with_deletes(pieces: Iterable[dict[str, dict[str, Any]]], deletes: dict[str, list[str]],
                  size: int) -> Iterator[Items]:
    """Each piece with no deletes, then the deletes in pieces of at most ``size``, the last upserts' first."""
    upserts: dict[str, dict[str, Any]] = {}
    for piece in pieces:
        if upserts:
            yield upserts, {}
        upserts = piece
    removals: dict[str, list[str]] = {}
    n = sum(map(len, upserts.values()))
    yielded = False
    for partition, keys in deletes.items():
        i = 0
        while i < len(keys):
            if n >= size:
                yield upserts, removals
                upserts, removals, n, yielded = {}, {}, 0, True
            part = keys[i:i + size - n]
            removals[partition] = part
            n += len(part)
            i += len(part)
    if n or not yielded:  # an empty poll is still one (empty) message
        yield upserts, removals


def _payloads(items: Iterable[Items], max_frame_bytes: int) -> Iterator[bytes]:
    for piece in items:
        payload = _pack_items(*piece)
        if len(payload) + _DELTA_HEAD_BYTES <= max_frame_bytes:
            yield payload
            continue
        n = _count(piece)
        if n <= 1:
            raise ProtocolError(
                f"one entry encodes to {len(payload)} bytes, over the {max_frame_bytes}-byte frame limit")
        yield from _payloads(_halves(piece, (n + 1) // 2), max_frame_bytes)


def _halves(piece: Items, size: int) -> Iterator[Items]:
    """``piece`` split in pieces of at most ``size`` entries (one over the frame limit)."""
    upserts, deletes = piece
    return _with_deletes(upsert_pieces(upserts, size), {p: list(keys) for p, keys in deletes.items()}, size)
