"""One record type per message kind: each field's name, type and check live here only.

:mod:`poller.wire.protocol` packs a record's fields as a msgpack map and checks a decoded map against the record
before building it. A field with a default was added after its kind was first defined: a peer that predates it
leaves it out (and a record leaves it out while ``None``, so an older receiver is not shown a ``nil`` it would
refuse). Extra fields in a received map are ignored (forward compatibility within one protocol version).
"""

from __future__ import annotations

import enum
import math
from typing import Any, Callable, Mapping, NamedTuple, Union

from poller.wire.errors import ProtocolError

__all__ = ["Kind", "Ready", "Delta", "Heartbeat", "Error", "Bye", "Log", "Stop", "Resync", "Sync", "Ack", "Watch",
           "Body", "MAX_WATCH_KEYS", "RECORDS", "check_body", "to_record", "as_map"]


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
    interval: float


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
    sync: Count | None = None


class Heartbeat(NamedTuple):
    polls: int
    source_errors: int
    rss: int
    stalled_s: float
    source_stalls: Count | None = None
    # The seq of the last message sent before this heartbeat; a poller that sends it asks for an ACK.
    last_seq: LastSeq | None = None
    # Keys the poller leaves out of the stream (poller.quarantine): how many, and the first few by name.
    quarantined: Count | None = None
    quarantined_keys: Named | None = None
    # Full listings of the source (poller.duty): how many, the last one's duration, their total, their share.
    listings: Count | None = None
    listing_s: Seconds | None = None
    listing_total_s: Seconds | None = None
    listing_share: Share | None = None
    # The watch (poller.polling): reads of waited-on keys so far, and the listings a change seen there brought forward.
    watch_reads: Count | None = None
    watch_listings: Count | None = None


class Error(NamedTuple):
    type: str
    message: str
    traceback: str
    fatal: bool
    count: int | None = None  # type: ignore[assignment]  # the wire name; shadows tuple.count


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
    # The last seq the buffer had received when it asked: a snapshot started after it is already the answer.
    after: LastSeq | None = None


class Sync(NamedTuple):
    token: Token
    # Partitions the listing that answers ``token`` must include (and every later one), on a source that lists
    # a chosen set of them (poller.sources.transferqueue).
    partitions: PartitionIds | None = None


class Ack(NamedTuple):
    seq: int


class Watch(NamedTuple):
    """Watch ``keys`` of ``partition`` for ``seconds`` (renewed by the next WATCH); no keys: stop watching."""

    partition: str
    keys: WatchKeys
    seconds: Seconds


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


def is_int(value: Any) -> bool:
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
    "int": (is_int, None),
    "float": (_is_number, None),
    "str": (lambda v: isinstance(v, str), None),
    "bool": (lambda v: isinstance(v, bool), None),
    "Count": (is_int, lambda v: v >= 0),
    "Token": (is_int, lambda v: v > 0),
    "LastSeq": (is_int, lambda v: v >= -1),
    "Seconds": (_is_number, lambda v: 0 <= v < math.inf),
    "Share": (_is_number, lambda v: 0 <= v <= 1),
    "Packed": (_packed_ok, None),
    "Deletes": (lambda v: isinstance(v, dict) and all(isinstance(p, str) and _strs(k) for p, k in v.items()), None),
    "Named": (lambda v: isinstance(v, list) and len(v) <= 64 and all(
        _strs(entry) and len(entry) == 3 for entry in v), None),
    "PartitionIds": (lambda v: _strs(v, MAX_PARTITION_IDS) and all(v), None),
    "WatchKeys": (lambda v: _strs(v, MAX_WATCH_KEYS), None),
}


def _fields(record: Any) -> list[tuple[str, str, bool]]:
    """(name, type name, required) of each field of ``record``, from its annotations."""
    out = []
    for name in record._fields:
        hint = record.__annotations__[name]
        annotation = str(getattr(hint, "__forward_arg__", hint))  # NamedTuple keeps them as ForwardRef
        out.append((name, annotation.split(" | ")[0], name not in record._field_defaults))
    return out


_SCHEMAS = {kind: _fields(record) for kind, record in RECORDS.items()}


def check_body(kind: Kind, body: Mapping[str, Any]) -> None:
    """Check ``body`` against the record of ``kind``.

    Raises:
        ProtocolError: a required field is missing, or a field has the wrong type or value.
    """
    if kind is Kind.DELTA and body.get("upserts", {}) != {}:
        raise ProtocolError("DELTA upserts must be empty: since protocol 2 tags travel packed per key in "
                            "'packed' (a poller writes 'upserts' empty, for the first protocol 2 buffers)")
    for name, type_name, required in _SCHEMAS[kind]:
        if name not in body:
            if required:
                raise ProtocolError(f"{kind.name} body lacks field {name!r}")
            continue
        value, (is_type, in_bounds) = body[name], _CHECKS[type_name]
        if not is_type(value):
            raise ProtocolError(f"{kind.name} field {name!r} has the wrong type {type(value).__name__}")
        if in_bounds is not None and not in_bounds(value):
            raise ProtocolError(f"{kind.name} field {name!r} has a wrong value {value!r}")


def to_record(kind: Kind, body: Mapping[str, Any]) -> Body:
    """The record of ``kind`` from a map :func:`check_body` accepted."""
    record = RECORDS[kind]
    return record(*(body.get(name) for name in record._fields))  # type: ignore[no-any-return]


def as_map(kind: Kind, body: Body | Mapping[str, Any]) -> Mapping[str, Any]:
    """What goes on the wire for ``body``: a record's fields (less unset optional ones), or a map as it is."""
    if isinstance(body, tuple):
        record = RECORDS[kind]
        if not isinstance(body, record):
            raise ProtocolError(f"a {type(body).__name__} is not a {kind.name} body")
        defaults = record._field_defaults
        return {name: value for name, value in zip(record._fields, body)
                if not (value is None and name in defaults)}
    return body
