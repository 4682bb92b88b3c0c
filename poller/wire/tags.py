"""The tag codec: one key's tags as bytes, on the wire and in the trainer's store, held to one set of limits.

A poller screens a source's tags against the :class:`~poller.wire.protocol.Limits` the trainer's unpack enforces
(:func:`screen`: what would be refused is left out as :class:`Refused`, numpy/torch values made plain) and packs
each key's tags alone (:func:`pack_tags`); the trainer checks them as they arrive (:func:`unpack_many_tags`), keeps
them packed (:func:`freeze`) and unpacks what it hands out (:func:`thaw`). Tags packed by either side compare as
bytes: how both decide "did it change?".
"""

from __future__ import annotations

import copy
import sys
from itertools import chain
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import msgpack

from poller.wire.errors import ProtocolError
from poller.wire.protocol import DEFAULT_LIMITS, SCALAR_TYPES, Limits, deeper_than, packed_size, unpack_bounded
from poller.wire.vocabulary import Tags, UnreadableValue

__all__ = ["Refused", "screen", "pack_tags", "pack_many_tags", "fresh_strs", "unpack_tags", "unpack_many_tags",
           "freeze", "thaw", "thaw_many"]

STR_ONLY = frozenset({str})
DICT_ONLY = frozenset({dict})
# Tags sit at depth 4 of a DELTA body (body -> packed -> partition -> tags), so max_depth counts from there.
TAGS_DEPTH = 4


# -- the poller's half: a source's tags screened against the limits unpack_tags enforces, then packed --
#
# The unit of failure is the record: a key the receiver would refuse is left out, with its reason, while the rest
# flows. A value with one faithful plain form is converted instead: numpy and torch scalars (and 0-d tensors) to
# int / float / bool, their arrays to nested lists, tuples to lists; neither is imported: such a value is known by
# its type's module and read with its own item() / tolist().

# msgpack's integer range: uint64 above, int64 below.
_INT_MAX = 2**64 - 1
_INT_MIN = -(2**63)
# What iter_encode_delta puts around one key in the worst case, beyond its tags.
_FRAME_SLACK = 1024


class Refused(NamedTuple):
    """One key left out of the stream: its partition id and key as listed, and why."""

    partition: Any
    key: Any
    reason: str


class _Refuse(Exception):
    """Raised inside the walk; carries the reason (the key's :class:`Refused` reason)."""


def _numeric(value: Any, limits: Limits, depth: int, budget: list[int]) -> Any:
    """A numpy or torch value's plain form (a scalar's number, an array's nested lists), else raises _Refuse."""
    module = type(value).__module__.partition(".")[0]
    if module not in ("numpy", "torch"):
        raise _Refuse(f"a {type(value).__module__}.{type(value).__qualname__} value is not plain data "
                      f"(str, int, float, bool, None, bytes, lists and maps)")
    try:
        shape = tuple(getattr(value, "shape", ()))
        plain = value.item() if shape == () else value.tolist()
    except Exception as exc:  # no Python form at all
        raise _Refuse(f"a {module} {type(value).__name__} has no plain value: {exc}") from None
    if shape == ():
        if type(plain) not in (int, float, bool):
            raise _Refuse(f"a {module} {type(value).__name__} holds a {type(plain).__name__}, not a number")
        return plain
    # An array's elements go through the same checks as any list (complex, str or object ones are refused).
    return _plain(plain, limits, depth, budget)


def _plain(value: Any, limits: Limits, depth: int, budget: list[int]) -> Any:
    """``value`` as plain data the receiver accepts (converted where faithful); raises _Refuse.

    ``budget`` holds how many more values the walk may visit: a structure shared with itself over and over
    (``a = [x, x]; b = [a, a]; ...``) would otherwise cost 2**depth, and a poller must never hang on a record.
    """
    budget[0] -= 1
    if budget[0] < 0:
        raise _Refuse(f"more than max_items={limits.max_items} values in all")
    kind = type(value)
    if kind is not str and isinstance(value, str):  # a StrEnum and the like: its plain text
        value, kind = str.__str__(value), str
    if kind is str:
        if len(value) * 4 > limits.max_str_len or not value.isascii():
            try:
                size = len(value.encode())
            except UnicodeEncodeError as exc:
                raise _Refuse(f"a string that is not valid UTF-8 ({exc.reason} at {exc.start})") from None
            if size > limits.max_str_len:
                raise _Refuse(f"a value of {size} bytes exceeds max_str_len={limits.max_str_len}")
        return value
    if kind is int:
        if not _INT_MIN <= value <= _INT_MAX:
            raise _Refuse(f"the int {_short(value)} fits no msgpack integer (-2**63 .. 2**64-1)")
        return value
    if kind in (float, bool) or value is None:
        return value
    if kind in (bytes, bytearray, memoryview):
        if len(value) > limits.max_str_len:
            raise _Refuse(f"a value of {len(value)} bytes exceeds max_str_len={limits.max_str_len}")
        return bytes(value) if kind is not bytes else value
    if isinstance(value, UnreadableValue):
        raise _Refuse(f"the source could not read a value: {value.reason}")
    if depth > limits.max_depth:
        raise _Refuse(f"nested deeper than max_depth={limits.max_depth}")
    if isinstance(value, Mapping):
        if len(value) > limits.max_items:
            raise _Refuse(f"a map of {len(value)} entries exceeds max_items={limits.max_items}")
        out = {}
        for name, item in value.items():
            if type(name) is not str:
                raise _Refuse(f"tag name {_short(name)} is {type(name).__name__}, not str")
            out[_plain(name, limits, depth + 1, budget)] = _plain(item, limits, depth + 1, budget)
        return out
    if isinstance(value, (list, tuple)):
        if len(value) > limits.max_items:
            raise _Refuse(f"a list of {len(value)} items exceeds max_items={limits.max_items}")
        return [_plain(item, limits, depth + 1, budget) for item in value]
    if isinstance(value, (int, float)) and not type(value).__module__.startswith(("numpy", "torch")):
        return int(value) if isinstance(value, int) else float(value)  # an IntEnum, a float subclass
    return _numeric(value, limits, depth, budget)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _plainly_fine(items: Mapping[str, Any], limits: Limits) -> bool:
    """The common case in C-level passes (flat scalars, str names, short ASCII); ``False``: "look closer" (~10x)."""
    if limits.max_depth <= TAGS_DEPTH:
        return False
    try:
        values = list(chain.from_iterable(map(dict.values, items.values())))
        names = set(chain.from_iterable(items.values()))  # tag names repeat from key to key: a small set
    except TypeError:  # tags that are Mappings but not dicts
        return False
    types = set(map(type, values))
    if not types <= SCALAR_TYPES or not set(map(type, names)) <= STR_ONLY:
        return False
    widest = max(map(len, items.values()), default=0)
    if widest > limits.max_items:
        return False
    if int in types:
        # isinstance, so bools come along: always in range, and a filter in C.
        ints = list(filter(int.__instancecheck__, values))
        if max(ints) > _INT_MAX or min(ints) < _INT_MIN:
            return False
    strings = set(filter(str.__instancecheck__, values)) if str in types else set()
    blobs = set(filter(bytes.__instancecheck__, values)) if bytes in types else set()
    # Non-ASCII text: its UTF-8 length and validity are checked per key.
    if not all(map(str.isascii, strings)) or not all(map(str.isascii, names)) or not all(map(str.isascii, items)):
        return False
    longest = max(max(map(len, names), default=0), max(map(len, strings), default=0),
                  max(map(len, blobs), default=0), max(map(len, items), default=0))
    if longest > limits.max_str_len:
        return False
    # The largest a key's tags could encode to: every name and value the longest.
    return widest * 2 * (longest + 9) + _FRAME_SLACK <= limits.max_frame_bytes


def _screen_tags(key: str, tags: Any, limits: Limits) -> Any:
    """The plain tags of one key; raises _Refuse naming what the wire cannot carry."""
    if len(key) * 4 > limits.max_str_len or not key.isascii():
        _plain(key, limits, TAGS_DEPTH, [1])
    try:
        plain = _plain(tags, limits, TAGS_DEPTH - 1, [limits.max_items])
    except RecursionError:
        # max_depth is the receiver's to choose: past this interpreter's recursion limit the walk itself gives out
        # before it. Uncaught, one such record (any source's) failed every poll and ended the poller (issue 38).
        raise _Refuse(f"nested deeper than the poller can walk (recursion limit {sys.getrecursionlimit()})") from None
    try:
        size = packed_size(plain)
    except (TypeError, ValueError, OverflowError) as exc:  # what the walk let through and msgpack did not
        raise _Refuse(f"msgpack cannot encode it: {exc}") from None
    if size + len(key) * 4 + _FRAME_SLACK > limits.max_frame_bytes:
        raise _Refuse(f"its tags encode to {size} bytes, over max_frame_bytes={limits.max_frame_bytes}")
    return plain


def screen(partition: str, items: dict[str, Any], refused: list[Refused], limits: Limits) -> bool:
    """Convert what converts, move what the receiver would refuse from ``items`` to ``refused``; True if changed."""
    if len(partition) * 4 > limits.max_str_len or not partition.isascii():
        try:
            _plain(partition, limits, TAGS_DEPTH, [1])
        except _Refuse as exc:
            refused.extend(Refused(partition, key, f"partition id: {exc}") for key in items)
            items.clear()
            return True
    if _plainly_fine(items, limits):
        return False
    for key in list(items):
        try:
            items[key] = _screen_tags(key, items[key], limits)
        except _Refuse as exc:
            del items[key]
            refused.append(Refused(partition, key, str(exc)))
    return True


def pack_tags(tags: Mapping[str, Any], *, exact: bool = False) -> bytes | None:
    """``tags`` packed as a poller packs them for the wire, or ``None`` if msgpack cannot.

    ``exact``: only if unpacking gives the same values back (no tuple, no subclass), the store's form (:func:`freeze`).
    """
    try:
        return msgpack.packb(tags, use_bin_type=True, strict_types=exact)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError):
        return None


def pack_many_tags(many: Iterable[Any]) -> list[bytes | None]:
    """:func:`pack_tags` of each, in one C-level pass where every one packs (K=100k: ~45 ms a poll)."""
    many = list(many)
    try:
        return list(map(msgpack.Packer(use_bin_type=True).pack, many))
    except (TypeError, ValueError, OverflowError):
        return [pack_tags(tags) for tags in many]


def fresh_strs(strs: Sequence[str]) -> list[str]:
    """New objects equal to ``strs`` (one msgpack round trip, in C).

    A listing's own key objects, kept among its freed tag dicts, would keep its memory resident (1M keys: ~550 MB).
    """
    return msgpack.unpackb(msgpack.packb(list(strs)), raw=False)  # type: ignore[no-any-return]


# -- the trainer's half: what arrives, checked to the same limits -----------------------------------

def unpack_tags(blob: bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """One key's tags from a DELTA's ``packed``, held to the decoder's bounds.

    Raises:
        ProtocolError: the bytes are not one msgpack map with ``str`` names within ``limits``.
    """
    tags = unpack_bounded(blob, limits, "packed tags")
    if type(tags) is not dict or not set(map(type, tags)) <= STR_ONLY:
        raise ProtocolError("packed tags are not a map with str names")
    if not SCALAR_TYPES.issuperset(map(type, tags.values())) and deeper_than(tags, limits.max_depth, TAGS_DEPTH):
        raise ProtocolError(f"DELTA tags nest deeper than {limits.max_depth}")
    return tags


def unpack_many_tags(blobs: Sequence[bytes], limits: Limits = DEFAULT_LIMITS) -> list[dict[str, Any]]:
    """:func:`unpack_tags` of each blob, checked in C-level passes (~1 us a key, where a call each costs ~4).

    Raises:
        ProtocolError: as :func:`unpack_tags`, for the first blob refused.
    """
    try:
        tags = _unpack_each(blobs, limits)
    except Exception:  # one of them is malformed: name it
        return [unpack_tags(blob, limits) for blob in blobs]
    # The names' types from the set of distinct names (a few), not from every key's.
    if not set(map(type, tags)) <= DICT_ONLY or not set(map(type, set().union(*tags))) <= STR_ONLY:
        return [unpack_tags(blob, limits) for blob in blobs]
    if not SCALAR_TYPES.issuperset(map(type, chain.from_iterable(map(dict.values, tags)))):
        for one in tags:
            if not SCALAR_TYPES.issuperset(map(type, one.values())) and deeper_than(one, limits.max_depth,
                                                                                       TAGS_DEPTH):
                raise ProtocolError(f"DELTA tags nest deeper than {limits.max_depth}")
    return tags


def _unpack_each(blobs: Sequence[bytes], limits: Limits | None) -> list[Any]:
    """Each blob's one msgpack object, read by one unpacker from the blobs joined (~0.55 us a key, not ~0.9).

    ``limits=None``: bytes the store holds. Raises ValueError (or msgpack's errors) unless each blob is exactly one
    object: joined, a long blob and a short one could read as two.
    """
    joined = b"".join(blobs)
    bounds = {} if limits is None else dict(max_str_len=limits.max_str_len, max_bin_len=limits.max_str_len,
                                            max_array_len=limits.max_items, max_map_len=limits.max_items, max_ext_len=0)
    unpacker = msgpack.Unpacker(raw=False, use_list=True, strict_map_key=limits is not None,
                                max_buffer_size=max(len(joined), 1), **bounds)
    unpacker.feed(joined)
    unpack, tell = unpacker.unpack, unpacker.tell
    out: list[Any] = []
    end = 0
    for size in map(len, blobs):
        out.append(unpack())
        end += size
        if tell() != end:
            raise ValueError("a packed value is not exactly one msgpack object")
    return out


# -- what the trainer's store holds per key: packed tags, or the dict itself ---------------------

def freeze(tags: Tags) -> Any:
    """``tags`` packed (:func:`pack_tags` ``exact``), or the dict itself when packing would change them."""
    packed = pack_tags(tags, exact=True)
    return tags if packed is None else packed


def thaw(held: Any) -> Tags:
    """A fresh dict of held tags: bytes checked as they arrived or packed here, or a dict (copied)."""
    if type(held) is bytes:
        return msgpack.unpackb(held, raw=False, strict_map_key=False)  # type: ignore[no-any-return]
    return copy.deepcopy(held)


def thaw_many(blobs: Sequence[bytes]) -> list[dict[str, Any]]:
    """:func:`thaw` of each of the held bytes, read by one unpacker."""
    return _unpack_each(blobs, None)
