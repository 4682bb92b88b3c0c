"""The tag codec: one key's tags as bytes, on the wire and in the trainer's store.

A poller packs each key's tags alone (:func:`pack_tags`); the trainer checks them as they arrive
(:func:`unpack_many_tags`), keeps them packed (:func:`freeze`) and unpacks what it hands out (:func:`thaw`). Tags
packed by either side compare as bytes: how both decide "did it change?".
"""

from __future__ import annotations

import copy
from itertools import chain
from typing import Any, Iterable, Mapping, Sequence

import msgpack

from poller.wire.errors import ProtocolError
from poller.wire.protocol import DEFAULT_LIMITS, SCALAR_TYPES, Limits, deeper_than, unpack_bounded
from poller.wire.vocabulary import Tags

__all__ = ["pack_tags", "pack_many_tags", "fresh_strs", "unpack_tags", "unpack_many_tags", "freeze", "thaw",
           "thaw_many"]

STR_ONLY = frozenset({str})
DICT_ONLY = frozenset({dict})
# Tags sit at depth 4 of a DELTA body (body -> packed -> partition -> tags), so max_depth counts from there.
TAGS_DEPTH = 4


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
