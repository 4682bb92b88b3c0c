"""The wire format: pure functions between messages and ZeroMQ frames.

Nothing here touches a socket. Both sides of the stream import this module,
the one place that knows the stream's format (:mod:`poller.sources.tq_protocol`
speaks TransferQueue's own).

A message is two frames::

    header = msgpack [version, kind, epoch, seq]
    body   = msgpack map, whose shape depends on ``kind``

``epoch`` is chosen anew each time a poller process starts; ``seq`` counts the
messages of one epoch from 0 (READY) upward. A receiver that sees a gap in
``seq`` has lost something and asks for a RESYNC (a full snapshot) instead of
silently diverging.

Decoding is strict and bounded: frame sizes are capped, every field is
type-checked, unknown kinds and versions are refused. Every failure is a
:class:`~poller.errors.ProtocolError`; no other exception escapes
:func:`decode`. Pickle is never used.
"""

from __future__ import annotations

from functools import partial
from itertools import chain
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

import msgpack

from .errors import ProtocolError
from .messages import Body, Delta, Kind, as_map, check_body, to_record

__all__ = [
    "PROTOCOL_VERSION",
    "Kind",
    "Limits",
    "Message",
    "encode",
    "encode_body",
    "encode_header",
    "decode",
    "encode_delta",
    "iter_encode_delta",
    "iter_encode_pieces",
    "upsert_pieces",
    "packed_size",
    "fit_text",
    "unpack_tags",
    "unpack_many_tags",
    "pack_tags",
    "unpack_held",
    "pack_upserts",
    "pack_many_tags",
    "fresh_strs",
    "delta_upserts",
]

# 2: DELTA upserts travel packed per key (``Delta.packed``).
PROTOCOL_VERSION = 2


# NamedTuples rather than dataclasses in every module the poller process
# imports: dataclasses pulls in inspect, ~8 ms of its start-up.
class _LimitFields(NamedTuple):
    """The fields of :class:`Limits`, with their defaults."""

    max_frame_bytes: int = 64 * 1024 * 1024
    max_header_bytes: int = 128
    max_str_len: int = 1024 * 1024
    max_items: int = 1_000_000
    max_keys_per_message: int = 65_536
    max_depth: int = 32
    max_peers: int = 1024


class Limits(_LimitFields):
    """Bounds on what one peer can make the buffer decode and hold.

    A message past any decoding bound is a counted, logged
    :class:`~poller.errors.ProtocolError` and is dropped whole.

    Attributes:
        max_frame_bytes: size of a body frame; larger frames are also refused
            by libzmq before they are read whole (``ZMQ_MAXMSGSIZE``), which
            disconnects the sender.
        max_header_bytes: size of a header frame.
        max_str_len: length of one string or binary value (keys, tag values).
        max_items: entries of one map or array.
        max_keys_per_message: partitions plus keys (upserts and deletes) in
            one DELTA; the poller sends at most 4096 per message.
        max_depth: nesting of maps and arrays in a body (the DELTA structure
            itself uses 4 levels), so that no tag value can make ``snapshot()``
            recurse without bound.
        max_peers: streams (peer identities) the receiver keeps state for; past
            it, the one silent longest is forgotten (it resyncs if it returns).
    """

    __slots__ = ()

    def __new__(cls, *args: int, **kwargs: int) -> "Limits":
        self = super().__new__(cls, *args, **kwargs)
        for name, value in zip(self._fields, self):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")
        return self


DEFAULT_LIMITS = Limits()


class Message(NamedTuple):
    """One message. Decoded, ``body`` is the record of ``kind`` (:mod:`poller.messages`);
    to encode, a record or a plain map (a hand-driven peer's) will do."""

    kind: Kind
    epoch: int
    seq: int
    body: Any


def encode_header(kind: Kind, epoch: int, seq: int) -> bytes:
    """Pack the header frame. Cheap, so the sending thread can stamp ``seq``."""
    return msgpack.packb([PROTOCOL_VERSION, int(kind), epoch, seq])


def encode_body(kind: Kind, body: Body | Mapping[str, Any]) -> bytes:
    """Check and pack a body: the record of ``kind``, or a map of its fields.

    Raises:
        ProtocolError: the body does not fit ``kind`` or holds values msgpack
            cannot encode (the message names the offending type).
    """
    try:
        fields = as_map(kind, body)
        check_body(kind, fields)
        return msgpack.packb(fields, use_bin_type=True)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {kind.name} body: {exc}") from exc


def encode(message: Message) -> list[bytes]:
    """Encode a whole message into its two frames."""
    return [
        encode_header(message.kind, message.epoch, message.seq),
        encode_body(message.kind, message.body),
    ]


def packed_size(value: Any) -> int:
    """How many bytes ``value`` takes in a body, as a DELTA packs it.

    Raises:
        TypeError, ValueError, OverflowError: msgpack cannot encode ``value``.
    """
    return len(msgpack.packb(value, use_bin_type=True))


def fit_text(text: str, limits: Limits | None) -> str:
    """``text`` cut to ``limits.max_str_len`` UTF-8 bytes, so a receiver with those limits takes it.

    For what a poller says about itself (ERROR and LOG text), which must
    reach a receiver with small limits rather than be refused whole.
    """
    if limits is None or len(text) * 4 <= limits.max_str_len:
        return text
    raw = text.encode(errors="surrogatepass")
    if len(raw) <= limits.max_str_len:
        return text
    return raw[:limits.max_str_len].decode(errors="ignore")


def decode(frames: Sequence[bytes | memoryview], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode and check the two frames of one message.

    Raises:
        ProtocolError: for anything but a well-formed message of a known kind
            and of this protocol version.
    """
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    header_frame, body_frame = frames
    if len(header_frame) > limits.max_header_bytes:
        raise ProtocolError(f"header frame of {len(header_frame)} bytes exceeds {limits.max_header_bytes}")
    if len(body_frame) > limits.max_frame_bytes:
        raise ProtocolError(f"body frame of {len(body_frame)} bytes exceeds {limits.max_frame_bytes}")
    header = _unpack(header_frame, limits, "header frame")
    if not isinstance(header, list) or len(header) != 4:
        raise ProtocolError("header is not [version, kind, epoch, seq]")
    version, kind_value, epoch, seq = header
    if not _is_int(version):
        raise ProtocolError("header version is not an integer")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {PROTOCOL_VERSION})")
    if not _is_int(kind_value):
        raise ProtocolError("header kind is not an integer")
    try:
        kind = Kind(kind_value)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind_value}") from None
    if not _is_int(epoch) or not _is_int(seq) or seq < 0 or epoch < 0:
        raise ProtocolError("header epoch/seq are not non-negative integers")
    body = _unpack(body_frame, limits, "body frame")
    if not isinstance(body, dict):
        raise ProtocolError(f"{kind.name} body is not a map")
    check_body(kind, body)
    if kind is Kind.DELTA:
        _check_delta_bounds(body, limits)
    elif _deeper_than(body, limits.max_depth):
        raise ProtocolError(f"{kind.name} body nests deeper than {limits.max_depth}")
    return Message(kind, epoch, seq, to_record(kind, body))


_SCALAR_TYPES = frozenset({str, int, float, bool, bytes, type(None)})


def _deeper_than(value: Any, limit: int, depth: int = 1) -> bool:
    """True if maps/arrays in ``value`` (itself at ``depth``) nest past ``limit``. Iterative."""
    stack = [(value, depth)]
    while stack:
        item, level = stack.pop()
        if level > limit:
            return True
        for child in (item.values() if isinstance(item, dict) else item):
            if isinstance(child, (dict, list)):
                stack.append((child, level + 1))
    return False


def _check_delta_bounds(body: dict[str, Any], limits: Limits) -> None:
    """Keys per message and nesting of a DELTA already checked by :func:`~poller.messages.check_body`."""
    upserts, deletes, packed = body["upserts"], body["deletes"], body.get("packed") or {}
    count = len(upserts) + len(deletes) + sum(len(v) for v in upserts.values()) + sum(len(v) for v in deletes.values())
    count += len(packed) + sum(len(keys) for keys, _ in packed.values())
    if count > limits.max_keys_per_message:
        raise ProtocolError(f"DELTA holds {count} partitions and keys, more than {limits.max_keys_per_message}")
    # The structure is body -> upserts -> partition -> tags (depth 4); only
    # tag values can nest further, so only they are walked.
    limit = limits.max_depth
    for items in upserts.values():
        # Tag values are almost always scalars: one pass at C speed over the
        # types of all of them, and a walk only where a container shows up.
        if _SCALAR_TYPES.issuperset(map(type, chain.from_iterable(map(dict.values, items.values())))):
            continue
        for tags in items.values():
            if _deeper_than(tags, limit, 4):
                raise ProtocolError(f"DELTA tags nest deeper than {limit}")
    others = {k: v for k, v in body.items() if k not in _BULKY}
    if _deeper_than(others, limits.max_depth):
        raise ProtocolError(f"DELTA body nests deeper than {limits.max_depth}")


def unpack_tags(blob: bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """One key's tags from its packed form in a DELTA's ``packed``, held to the decoder's bounds.

    The tags sit where plain upserts put them (depth 4 of the body), so
    ``max_depth`` means the same for both forms.

    Raises:
        ProtocolError: the bytes are not one msgpack map with ``str`` names
            within ``limits``.
    """
    tags = _unpack(blob, limits, "packed tags")
    if type(tags) is not dict or not set(map(type, tags)) <= _STR_NAMES:
        raise ProtocolError("packed tags are not a map with str names")
    if not _SCALAR_TYPES.issuperset(map(type, tags.values())) and _deeper_than(tags, limits.max_depth, 4):
        raise ProtocolError(f"DELTA tags nest deeper than {limits.max_depth}")
    return tags


def unpack_many_tags(blobs: Sequence[bytes], limits: Limits = DEFAULT_LIMITS) -> list[dict[str, Any]]:
    """:func:`unpack_tags` of each blob, checked in C-level passes over all of them.

    A snapshot unpacks every key once: one ``map`` over the blobs and set
    checks over all names and value types cost ~1 us a key where a call of
    :func:`unpack_tags` per key costs ~4. Only tags holding containers are
    walked for their depth; any failure is located by unpacking one by one.

    Raises:
        ProtocolError: as :func:`unpack_tags`, for the first blob refused.
    """
    unpack = partial(msgpack.unpackb, raw=False, use_list=True, strict_map_key=True,
                     max_str_len=limits.max_str_len, max_bin_len=limits.max_str_len,
                     max_array_len=limits.max_items, max_map_len=limits.max_items, max_ext_len=0)
    try:
        tags = list(map(unpack, blobs))
    except Exception:  # one of them is malformed: name it
        return [unpack_tags(blob, limits) for blob in blobs]
    if not set(map(type, tags)) <= _DICT or not set(map(type, chain.from_iterable(tags))) <= _STR_NAMES:
        return [unpack_tags(blob, limits) for blob in blobs]
    if not _SCALAR_TYPES.issuperset(map(type, chain.from_iterable(map(dict.values, tags)))):
        limit = limits.max_depth
        for one in tags:
            if not _SCALAR_TYPES.issuperset(map(type, one.values())) and _deeper_than(one, limit, 4):
                raise ProtocolError(f"DELTA tags nest deeper than {limit}")
    return tags


_STR_NAMES = frozenset({str})
_DICT = frozenset({dict})


def pack_tags(tags: Mapping[str, Any], *, exact: bool = False) -> bytes | None:
    """``tags`` packed as a poller packs them for the wire, or ``None`` if msgpack cannot.

    With ``exact``, only when unpacking gives the same values back
    (``strict_types``: a tuple would come back a list, a subclass as its
    base). The buffer's store holds tags in this form, so tags it was given
    and tags that arrived packed compare as bytes.
    """
    try:
        return msgpack.packb(tags, use_bin_type=True, strict_types=exact)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError):
        return None


def pack_upserts(upserts: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, bytes]]:
    """Each key's tags packed alone, as a DELTA's ``packed`` carries them; ``bytes`` are tags packed already.

    Raises:
        ProtocolError: tags msgpack cannot encode (screened tags never are).
    """
    packer = msgpack.Packer(use_bin_type=True)
    pack = packer.pack

    def one(tags: Any) -> bytes:
        return tags if type(tags) is bytes else pack(tags)  # type: ignore[no-any-return]

    out = {}
    try:
        for partition, items in upserts.items():
            values = list(items.values())
            kinds = set(map(type, values))
            if kinds <= _BYTES:  # all packed already (a resync's unchanged keys): taken as they are
                out[partition] = dict(items)
                continue
            # All tags (the usual case): packed in one C-level pass, no Python call per key.
            packed = map(one if bytes in kinds else pack, values)
            out[partition] = dict(zip(items, packed))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode DELTA items: {exc}") from exc
    return out


def pack_many_tags(many: Iterable[Any]) -> list[bytes]:
    """Each tags packed as :func:`pack_upserts` packs them, in one C-level pass.

    Raises:
        TypeError, ValueError, OverflowError: one of them msgpack cannot encode.
    """
    return list(map(msgpack.Packer(use_bin_type=True).pack, many))


def fresh_strs(strs: Sequence[str]) -> list[str]:
    """New objects equal to ``strs`` (through one msgpack round trip, in C).

    What a poller keeps from a listing of a million keys must not be the
    listing's own key objects: scattered among the freed tag dicts, they
    would keep the listing's memory resident (measured: ~550 MB held for
    ~200 MB of live data).
    """
    return msgpack.unpackb(msgpack.packb(list(strs)), raw=False)  # type: ignore[no-any-return]


def unpack_held(blob: bytes) -> dict[str, Any]:
    """Tags from bytes that were checked when they arrived (:func:`unpack_tags`) or :func:`pack_tags` made."""
    return msgpack.unpackb(blob, raw=False, strict_map_key=False)  # type: ignore[no-any-return]


def delta_upserts(delta: Delta, limits: Limits = DEFAULT_LIMITS) -> dict[str, dict[str, Any]]:
    """Every upsert of a decoded DELTA as plain tags: ``upserts`` and ``packed`` unpacked, in one map.

    For readers that want the tags themselves (tools, tests); the buffer
    applies ``packed`` without unpacking what it already holds.

    Raises:
        ProtocolError: packed tags the decoder refuses (:func:`unpack_tags`).
    """
    out = {partition: dict(items) for partition, items in delta.upserts.items()}
    for partition, (keys, blobs) in (delta.packed or {}).items():
        out.setdefault(partition, {}).update(zip(keys, (unpack_tags(blob, limits) for blob in blobs)))
    return out


def _unpack(frame: bytes | memoryview, limits: Limits, what: str) -> Any:
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_str_len,
            max_array_len=limits.max_items,
            max_map_len=limits.max_items,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of types; all mean "malformed"
        raise ProtocolError(f"malformed {what}: {type(exc).__name__}: {exc}") from exc


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- DELTA: a poll's changes in bounded bodies ---------------------------------------------------

# The fields a DELTA's record packs from its own values; the bulky ones are packed once, as the payload.
_BULKY = ("upserts", "deletes", "packed")
# Upper bound of the head encode_delta puts before the payload.
_DELTA_HEAD_BYTES = 64


def encode_delta(head: Delta, payload: bytes) -> bytes:
    """A DELTA body: ``head``'s own fields (its bulky ones ignored) before ``payload``.

    ``payload`` is the bulky fields packed once (:func:`iter_encode_delta`
    sizes and splits on it); msgpack maps are a plain concatenation of
    key/value encodings, so the head is packed from the record in front.
    """
    packer = msgpack.Packer(use_bin_type=True)
    fields = {name: value for name, value in as_map(Kind.DELTA, head).items() if name not in _BULKY}
    fields["t"] = float(fields["t"])
    return packer.pack_map_header(len(fields) + len(_BULKY)) + b"".join(
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
