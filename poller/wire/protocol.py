"""The wire format: pure functions between messages and ZeroMQ frames; no sockets.

A message is two frames: ``header = msgpack [version, kind, epoch, seq]`` and ``body = msgpack map`` shaped by
``kind`` (:mod:`poller.wire.messages`). ``epoch`` is new each time a poller process starts; ``seq`` counts an epoch's
messages from 0 (READY): a gap means something was lost, and the receiver asks for a RESYNC instead of diverging.

Decoding is strict and bounded (:class:`Limits`); every failure is a :class:`~poller.wire.errors.ProtocolError`.
No pickle. DELTA, the one bulky kind, is encoded a bounded body at a time (:func:`iter_encode_delta`).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

import msgpack

from poller.wire.errors import ProtocolError
from poller.wire.messages import Body, Delta, Kind, as_map, check_body, is_int, to_record

__all__ = ["PROTOCOL_VERSION", "Kind", "Limits", "Message", "Piece", "encode", "encode_body", "encode_header",
           "iter_encode_delta", "decode", "packed_size", "fit_text"]

# 2: DELTA upserts travel packed per key (``Delta.packed``).
PROTOCOL_VERSION = 2


class _LimitFields(NamedTuple):
    """The fields of :class:`Limits`, with their defaults (a NamedTuple: see :mod:`poller.wire.messages`)."""

    max_frame_bytes: int = 64 * 1024 * 1024
    max_header_bytes: int = 128
    max_str_len: int = 1024 * 1024
    max_items: int = 1_000_000
    max_keys_per_message: int = 65_536
    max_depth: int = 32
    max_peers: int = 1024


class Limits(_LimitFields):
    """Bounds on what one peer can make the buffer decode and hold.

    A message past any bound is dropped whole: a counted, logged :class:`~poller.wire.errors.ProtocolError`.

    Attributes:
        max_frame_bytes: size of a body frame; larger frames are also refused by libzmq before they are read whole
            (``ZMQ_MAXMSGSIZE``), which disconnects the sender.
        max_header_bytes: size of a header frame.
        max_str_len: length of one string or binary value (keys, tag values).
        max_items: entries of one map or array.
        max_keys_per_message: partitions plus keys (upserts and deletes) in one DELTA; the poller sends at most
            4096 per message.
        max_depth: nesting of maps and arrays in a body (the DELTA structure itself uses 4 levels), so that no tag
            value can make ``snapshot()`` recurse without bound.
        max_peers: streams (peer identities) the receiver keeps state for; past it, the one silent longest is
            forgotten (it resyncs if it returns).
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
    """One message; ``body`` is the record of ``kind`` (to encode, a plain map of its fields will do)."""

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
        ProtocolError: the body does not fit ``kind`` or holds values msgpack cannot encode.
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
    return [encode_header(message.kind, message.epoch, message.seq), encode_body(message.kind, message.body)]


def packed_size(value: Any) -> int:
    """How many bytes ``value`` takes in a body, as a DELTA packs it (raises as msgpack if it cannot)."""
    return len(msgpack.packb(value, use_bin_type=True))


def fit_text(text: str, limits: Limits | None) -> str:
    """``text`` cut to ``limits.max_str_len`` UTF-8 bytes: what a poller says about itself (ERROR, LOG) must
    reach a receiver with small limits rather than be refused whole."""
    if limits is None or len(text) * 4 <= limits.max_str_len:
        return text
    raw = text.encode(errors="surrogatepass")
    if len(raw) <= limits.max_str_len:
        return text
    return raw[:limits.max_str_len].decode(errors="ignore")


#: A poll's upserts, or a part of them: per partition, its keys and each key's packed tags (a DELTA's ``packed``).
Piece = dict[str, tuple[list[str], list[bytes]]]

# The fields a DELTA body packs once as its payload (the rest are packed from the record before it),
# and an upper bound of what goes before them.
_DELTA_BULKY_FIELDS = ("upserts", "packed", "deletes")
_DELTA_HEAD_BYTES = 64


def iter_encode_delta(pieces: Iterable[Piece], deletes: Mapping[str, list[str]], *, poll: int, started: float,
                      full: bool, chunk_items: int, max_frame_bytes: int, sync: int = 0) -> Iterator[bytes]:
    """A poll as DELTA bodies of at most ``chunk_items`` keys, each under ``max_frame_bytes``, one at a time.

    The first body of a full snapshot carries ``reset``, the last of every poll ``end``. A piece is taken only when
    the body before it was handed on (an empty piece sends what came before it at once); ``deletes`` is read last.
    After a ProtocolError the poll has no ``end`` and is sent again, which the receiver tolerates.

    Raises:
        ProtocolError: one key whose tags alone exceed ``max_frame_bytes`` (the screen lets none through).
    """
    head = Delta(poll=poll, t=float(started), full=full, reset=full, end=False, packed={}, deletes={}, sync=sync)
    previous: bytes | None = None
    for payload in _payloads(_batches(pieces, deletes, chunk_items), max_frame_bytes):
        if previous is not None:
            yield _delta_body(head, previous)
            head = head._replace(reset=False)
        previous = payload
    assert previous is not None  # _batches yields at least one batch
    yield _delta_body(head._replace(end=True), previous)


def _delta_body(head: Delta, payload: bytes) -> bytes:
    """``head``'s own fields before ``payload``: a msgpack map is its keys and values, concatenated."""
    packer = msgpack.Packer(use_bin_type=True)
    fields = {name: value for name, value in as_map(Kind.DELTA, head).items() if name not in _DELTA_BULKY_FIELDS}
    return packer.pack_map_header(len(fields) + len(_DELTA_BULKY_FIELDS)) + b"".join(
        packer.pack(name) + packer.pack(value) for name, value in fields.items()) + payload


def _batches(pieces: Iterable[Piece], deletes: Mapping[str, list[str]],
             size: int) -> Iterator[tuple[Piece, dict[str, list[str]]]]:
    """The pieces' keys in batches of at most ``size``, then the deletes, filling the last batch first."""
    batch: Piece = {}
    removals: dict[str, list[str]] = {}
    n = 0
    yielded = False
    for piece in pieces:
        if not piece and n:  # an empty piece: what came before it goes now
            yield batch, {}
            batch, n, yielded = {}, 0, True
        for partition, (keys, blobs) in piece.items():
            i = 0
            while i < len(keys):
                if n >= size:
                    yield batch, {}
                    batch, n, yielded = {}, 0, True
                j = min(i + size - n, len(keys))
                held = batch.get(partition)
                batch[partition] = (held[0] + keys[i:j], held[1] + blobs[i:j]) if held else (keys[i:j], blobs[i:j])
                n += j - i
                i = j
    for partition, gone in deletes.items():
        i = 0
        while i < len(gone):
            if n >= size:
                yield batch, removals
                batch, removals, n, yielded = {}, {}, 0, True
            part = gone[i:i + size - n]
            removals[partition] = part
            n += len(part)
            i += len(part)
    if n or not yielded:  # an empty poll is still one (empty) message
        yield batch, removals


def _payloads(batches: Iterable[tuple[Piece, dict[str, list[str]]]], max_frame_bytes: int) -> Iterator[bytes]:
    for upserts, deletes in batches:
        packer = msgpack.Packer(use_bin_type=True)
        payload = (packer.pack("upserts") + packer.pack({}) + packer.pack("packed") + packer.pack(upserts)
                   + packer.pack("deletes") + packer.pack(deletes))
        if len(payload) + _DELTA_HEAD_BYTES <= max_frame_bytes:
            yield payload
            continue
        n = sum(len(keys) for keys, _ in upserts.values()) + sum(map(len, deletes.values()))
        if n <= 1:
            raise ProtocolError(
                f"one entry encodes to {len(payload)} bytes, over the {max_frame_bytes}-byte frame limit")
        yield from _payloads(_batches([upserts], deletes, (n + 1) // 2), max_frame_bytes)


def decode(frames: Sequence[bytes | memoryview], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode and check the two frames of one message.

    Raises:
        ProtocolError: for anything but a well-formed message of a known kind and of this protocol version.
    """
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    header_frame, body_frame = frames
    if len(header_frame) > limits.max_header_bytes:
        raise ProtocolError(f"header frame of {len(header_frame)} bytes exceeds {limits.max_header_bytes}")
    if len(body_frame) > limits.max_frame_bytes:
        raise ProtocolError(f"body frame of {len(body_frame)} bytes exceeds {limits.max_frame_bytes}")
    header = unpack_bounded(header_frame, limits, "header frame")
    if not isinstance(header, list) or len(header) != 4:
        raise ProtocolError("header is not [version, kind, epoch, seq]")
    version, kind_value, epoch, seq = header
    if not is_int(version):
        raise ProtocolError("header version is not an integer")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {PROTOCOL_VERSION})")
    if not is_int(kind_value):
        raise ProtocolError("header kind is not an integer")
    try:
        kind = Kind(kind_value)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind_value}") from None
    if not is_int(epoch) or not is_int(seq) or seq < 0 or epoch < 0:
        raise ProtocolError("header epoch/seq are not non-negative integers")
    body = unpack_bounded(body_frame, limits, "body frame")
    if not isinstance(body, dict):
        raise ProtocolError(f"{kind.name} body is not a map")
    check_body(kind, body)
    nested = body
    if kind is Kind.DELTA:  # tags are checked as they are unpacked (poller.wire.tags); deletes are flat
        deletes, packed = body["deletes"], body["packed"]
        count = len(deletes) + sum(map(len, deletes.values())) + len(packed) + sum(len(k) for k, _ in packed.values())
        if count > limits.max_keys_per_message:
            raise ProtocolError(f"DELTA holds {count} partitions and keys, more than {limits.max_keys_per_message}")
        nested = {name: value for name, value in body.items() if name not in _DELTA_BULKY_FIELDS}
    if deeper_than(nested, limits.max_depth):
        raise ProtocolError(f"{kind.name} body nests deeper than {limits.max_depth}")
    return Message(kind, epoch, seq, to_record(kind, body))


SCALAR_TYPES = frozenset({str, int, float, bool, bytes, type(None)})


def deeper_than(value: Any, limit: int, depth: int = 1) -> bool:
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


def unpack_bounded(frame: bytes | memoryview, limits: Limits, what: str) -> Any:
    try:
        return msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=True, max_str_len=limits.max_str_len,
                               max_bin_len=limits.max_str_len, max_array_len=limits.max_items,
                               max_map_len=limits.max_items, max_ext_len=0)
    except Exception as exc:  # msgpack raises a zoo of types; all mean "malformed"
        raise ProtocolError(f"malformed {what}: {type(exc).__name__}: {exc}") from exc
