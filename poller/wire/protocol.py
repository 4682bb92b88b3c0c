"""The protocol the two processes speak: message records and their checks, frames, encoding, bounded decoding.

Pure functions, no sockets, in four sections:

- records: one per :class:`Kind`, each field's name, type and check here only. Every field is required; extra
  fields in a received map are ignored.
- frames: ``header = msgpack [version, kind, epoch, seq]``, ``body = msgpack map`` of the record's fields. ``epoch``
  is new per poller process; ``seq`` counts its messages from 0 (READY): a gap means a loss, answered by a RESYNC.
- encoding: DELTA, the one bulky kind, a bounded body at a time (:func:`iter_encode_delta`).
- decoding: strict and bounded (:class:`Limits`), every failure a :class:`~poller.wire.errors.ProtocolError`. No pickle.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence, Union

import msgpack

from poller.wire.errors import ProtocolError

__all__ = ["PROTOCOL_VERSION", "Kind", "Ready", "Delta", "Heartbeat", "Error", "Bye", "Log", "Stop", "Resync", "Sync",
           "Ack", "Watch", "Body", "MAX_WATCH_KEYS", "RECORDS", "check_body", "to_record", "as_map", "Limits",
           "Message", "Piece", "encode_body", "encode_header", "iter_encode_delta", "decode", "packed_size",
           "fit_text"]

PROTOCOL_VERSION = 1


# -- records -------------------------------------------------------------------------------------------------

class Kind(enum.IntEnum):
    """Message kinds. Poller to buffer below 16, buffer to poller from 16."""

    READY = 1
    DELTA = 2
    HEARTBEAT = 3
    ERROR = 4
    BYE = 5
    LOG = 6
    STOP = 16
    RESYNC = 17
    SYNC = 18  # poll now, and tag that listing with this token (ReplayBuffer.sync())
    ACK = 19  # the receiver heard a HEARTBEAT that carried ``last_seq``
    WATCH = 20


# Field types beyond the plain ones, named so their checks can be found by name.
Count = int          # a non-negative integer
Token = int          # a positive integer
LastSeq = int        # a sequence number, or -1 before the first message
Packed = dict        # {partition: [[key, ...], [packed tags, ...]]}
Named = list         # [[partition, key, reason], ...]: keys a poller names
Deletes = dict       # {partition: [key, ...]}
Seconds = float      # a finite duration >= 0
Share = float        # a share of the wall clock, in [0, 1]
PartitionIds = list  # [partition, ...]: at most MAX_PARTITION_IDS non-empty str
WatchKeys = list     # [key, ...]: at most MAX_WATCH_KEYS str

# NamedTuples rather than dataclasses in every module the poller process imports: dataclasses pulls in inspect (~8 ms).


class Ready(NamedTuple):
    pid: int
    name: str
    poll_interval: float


class Delta(NamedTuple):
    """One part of a poll: ``full`` (a snapshot), ``reset`` (its first part), ``end`` (the poll's last part).

    ``packed``: per partition, its keys and each key's tags packed alone
    (:mod:`poller.wire.tags`), kept by the receiver as they arrived.
    """

    poll: int
    t: float
    full: bool
    reset: bool
    end: bool
    packed: Packed
    deletes: Deletes
    # The highest SYNC token the poller had received when this poll's listing began (0: none).
    sync: Count


class Heartbeat(NamedTuple):
    polls: int
    source_errors: int
    rss: int
    stalled_s: float
    source_stalls: Count
    # The seq of the last message sent before this heartbeat; the receiver ACKs it (a mismatch asks a RESYNC).
    last_seq: LastSeq
    # Keys the poller leaves out of the stream (poller.quarantine): how many, and the first few by name.
    quarantined: Count
    quarantined_keys: Named
    # Full listings of the source (poller.duty): how many, the last one's duration, their total, their share.
    listings: Count
    listing_s: Seconds
    listing_total_s: Seconds
    listing_share: Share
    # The watch (poller.watch): reads of waited-on keys so far, and the listings a change seen there brought forward.
    watch_reads: Count
    watch_listings: Count


class Error(NamedTuple):
    type: str
    message: str
    traceback: str
    fatal: bool
    count: int  # type: ignore[assignment]  # failures in a row; the wire name shadows tuple.count


class Bye(NamedTuple):
    last_seq: int
    reason: str


class Log(NamedTuple):
    level: int
    name: str
    message: str


class Stop(NamedTuple):
    reason: str


class Resync(NamedTuple):
    reason: str
    # The last seq the buffer had received when it asked (-1: none): a snapshot started after it is the answer.
    after: LastSeq


class Sync(NamedTuple):
    token: Token
    # Partitions the listing that answers ``token`` must include (and every later one), on a source that lists
    # a chosen set of them (poller.sources.transferqueue); empty: none named.
    partitions: PartitionIds
    # A mark: the token is answered by the next poll as scheduled, none is asked for now (a removal's token,
    # buffer.ledger: a poll that answers it began after the removal).
    mark: bool


class Ack(NamedTuple):
    seq: int


class Watch(NamedTuple):
    """Watch ``keys`` of ``partition`` for ``seconds`` (renewed by the next WATCH); no keys: stop watching."""

    partition: str
    keys: WatchKeys
    seconds: Seconds
    # The least time between two listings a change seen brings forward (the waiting call's own listing rate).
    every: Seconds


Body = Union[Ready, Delta, Heartbeat, Error, Bye, Log, Stop, Resync, Sync, Ack, Watch]

RECORDS: dict[Kind, Any] = {Kind.READY: Ready, Kind.DELTA: Delta, Kind.HEARTBEAT: Heartbeat, Kind.ERROR: Error,
                            Kind.BYE: Bye, Kind.LOG: Log, Kind.STOP: Stop, Kind.RESYNC: Resync, Kind.SYNC: Sync,
                            Kind.ACK: Ack, Kind.WATCH: Watch}


#: The most partition ids one SYNC may name.
MAX_PARTITION_IDS = 1024
#: The most keys one WATCH may name: a targeted read of more costs the store as much as a small listing.
MAX_WATCH_KEYS = 256

_STR_ONLY = frozenset({str})
_BYTES_ONLY = frozenset({bytes})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _strs(value: Any, most: int | None = None) -> bool:
    """A list of at most ``most`` str."""
    return isinstance(value, list) and (most is None or len(value) <= most) and all(isinstance(s, str) for s in value)


def _packed_ok(value: Any) -> bool:
    """``{partition: [keys, blobs]}``: str partitions and keys, each key once, a bytes blob each (read by wire.tags)."""
    if type(value) is not dict:
        return False
    for partition, entry in value.items():
        if type(partition) is not str or type(entry) is not list or len(entry) != 2:
            return False
        keys, blobs = entry
        if type(keys) is not list or type(blobs) is not list or len(keys) != len(blobs):
            return False
        if not set(map(type, keys)) <= _STR_ONLY or not set(map(type, blobs)) <= _BYTES_ONLY:
            return False
        # A key twice would be applied against tags it no longer has: malformed, like a dict's.
        if len(set(keys)) != len(keys):
            return False
    return True


# Per field type: the type check (else "wrong type"), and the bounds it must keep (else "wrong value").
_CHECKS: dict[str, tuple[Callable[[Any], bool], Callable[[Any], bool] | None]] = {
    "int": (_is_int, None),
    "float": (_is_number, None),
    "str": (lambda v: isinstance(v, str), None),
    "bool": (lambda v: isinstance(v, bool), None),
    "Count": (_is_int, lambda v: v >= 0),
    "Token": (_is_int, lambda v: v > 0),
    "LastSeq": (_is_int, lambda v: v >= -1),
    "Seconds": (_is_number, lambda v: 0 <= v < math.inf),
    "Share": (_is_number, lambda v: 0 <= v <= 1),
    "Packed": (_packed_ok, None),
    "Deletes": (lambda v: isinstance(v, dict) and all(isinstance(p, str) and _strs(k) for p, k in v.items()), None),
    "Named": (lambda v: isinstance(v, list) and len(v) <= 64 and all(
        _strs(entry) and len(entry) == 3 for entry in v), None),
    "PartitionIds": (lambda v: _strs(v, MAX_PARTITION_IDS) and all(v), None),
    "WatchKeys": (lambda v: _strs(v, MAX_WATCH_KEYS), None),
}


def _fields(record: Any) -> list[tuple[str, str]]:
    """(name, type name) of each field of ``record``, from its annotations."""
    out = []
    for name in record._fields:
        hint = record.__annotations__[name]
        out.append((name, str(getattr(hint, "__forward_arg__", hint))))  # NamedTuple keeps them as ForwardRef
    return out


_SCHEMAS = {kind: _fields(record) for kind, record in RECORDS.items()}


def check_body(kind: Kind, body: Mapping[str, Any]) -> None:
    """Check ``body`` against the record of ``kind``.

    Raises:
        ProtocolError: a field is missing, or has the wrong type or value.
    """
    for name, type_name in _SCHEMAS[kind]:
        if name not in body:
            raise ProtocolError(f"{kind.name} body lacks field {name!r}")
        value, (is_type, in_bounds) = body[name], _CHECKS[type_name]
        if not is_type(value):
            raise ProtocolError(f"{kind.name} field {name!r} has the wrong type {type(value).__name__}")
        if in_bounds is not None and not in_bounds(value):
            raise ProtocolError(f"{kind.name} field {name!r} has a wrong value {value!r}")


def to_record(kind: Kind, body: Mapping[str, Any]) -> Body:
    """The record of ``kind`` from a map :func:`check_body` accepted."""
    record = RECORDS[kind]
    return record(*(body[name] for name in record._fields))  # type: ignore[no-any-return]


def as_map(kind: Kind, body: Body | Mapping[str, Any]) -> Mapping[str, Any]:
    """What goes on the wire for ``body``: a record's fields, or a map as it is."""
    if isinstance(body, tuple):
        if not isinstance(body, RECORDS[kind]):
            raise ProtocolError(f"a {type(body).__name__} is not a {kind.name} body")
        return body._asdict()
    return body


# -- frames --------------------------------------------------------------------------------------------------

class _LimitFields(NamedTuple):
    """The fields of :class:`Limits`, with their defaults (a NamedTuple, as the records are)."""

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


# -- encoding ------------------------------------------------------------------------------------------------

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
_DELTA_BULKY_FIELDS = ("packed", "deletes")
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
        payload = packer.pack("packed") + packer.pack(upserts) + packer.pack("deletes") + packer.pack(deletes)
        if len(payload) + _DELTA_HEAD_BYTES <= max_frame_bytes:
            yield payload
            continue
        n = sum(len(keys) for keys, _ in upserts.values()) + sum(map(len, deletes.values()))
        if n <= 1:
            raise ProtocolError(
                f"one entry encodes to {len(payload)} bytes, over the {max_frame_bytes}-byte frame limit")
        yield from _payloads(_batches([upserts], deletes, (n + 1) // 2), max_frame_bytes)


# -- decoding ------------------------------------------------------------------------------------------------

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
