"""The tag codec: one key's tags as bytes on the wire and in the trainer's store.

A poller packs each key's tags alone (:func:`pack_tags`, :func:`pack_upserts`);
the trainer checks them once when a DELTA arrives (:func:`unpack_many_tags`,
bounded by :class:`~poller.wire.protocol.Limits`), keeps them packed
(:func:`freeze`), and unpacks what it hands out (:func:`thaw`,
:func:`unpack_held_many`). Tags packed by either side compare as bytes.
"""

from __future__ import annotations

import copy
from itertools import chain
from typing import Any, Iterable, Mapping, Sequence

import msgpack

from poller.wire.errors import ProtocolError
from poller.wire.messages import Delta
from poller.wire.protocol import _SCALAR_TYPES, DEFAULT_LIMITS, Limits, _deeper_than, _unpack
from poller.wire.vocabulary import Tags

__all__ = ["pack_tags", "pack_upserts", "pack_many_tags", "fresh_strs", "unpack_tags", "unpack_many_tags",
           "unpack_held", "unpack_held_many", "delta_upserts", "freeze", "thaw"]

_BYTES = frozenset({bytes})

# -- packing (the poller) -----------------------------------------------------------------------

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


# -- unpacking (the trainer) --------------------------------------------------------------------

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
    try:
        tags = _unpack_each(blobs, limits)
    except Exception:  # one of them is malformed: name it
        return [unpack_tags(blob, limits) for blob in blobs]
    # The names' types from the set of distinct names (a few), not from every key's.
    if not set(map(type, tags)) <= _DICT or not set(map(type, set().union(*tags))) <= _STR_NAMES:
        return [unpack_tags(blob, limits) for blob in blobs]
    if not _SCALAR_TYPES.issuperset(map(type, chain.from_iterable(map(dict.values, tags)))):
        limit = limits.max_depth
        for one in tags:
            if not _SCALAR_TYPES.issuperset(map(type, one.values())) and _deeper_than(one, limit, 4):
                raise ProtocolError(f"DELTA tags nest deeper than {limit}")
    return tags


def _unpack_each(blobs: Sequence[bytes], limits: Limits) -> list[Any]:
    """Each blob's one msgpack object, read by one unpacker from the blobs joined.

    One unpacker costs ~0.55 us a key where a call of ``unpackb`` with the
    bounds as keywords costs ~0.9. Each blob must end where its object ends:
    joined, a blob with bytes to spare and a short one after it could
    otherwise read as two objects cut across their keys.

    Raises:
        ValueError: a blob is not exactly one object (or msgpack's own errors).
    """
    joined = b"".join(blobs)
    unpacker = msgpack.Unpacker(raw=False, use_list=True, strict_map_key=True,
                                max_buffer_size=max(len(joined), 1), max_str_len=limits.max_str_len,
                                max_bin_len=limits.max_str_len, max_array_len=limits.max_items,
                                max_map_len=limits.max_items, max_ext_len=0)
    unpacker.feed(joined)
    unpack, tell = unpacker.unpack, unpacker.tell
    out: list[Any] = []
    append = out.append
    end = 0
    for size in map(len, blobs):
        append(unpack())
        end += size
        if tell() != end:
            raise ValueError("a packed value is not exactly one msgpack object")
    return out


_STR_NAMES = frozenset({str})


_DICT = frozenset({dict})


def unpack_held(blob: bytes) -> dict[str, Any]:
    """Tags from bytes that were checked when they arrived (:func:`unpack_tags`) or :func:`pack_tags` made."""
    return msgpack.unpackb(blob, raw=False, strict_map_key=False)  # type: ignore[no-any-return]


def unpack_held_many(blobs: Sequence[bytes]) -> list[dict[str, Any]]:
    """:func:`unpack_held` of each blob, read by one unpacker in C (~0.44 us a key where a call each costs ~0.57).

    Each blob is one object already (checked when it arrived, or packed
    here), so the objects of the joined blobs are the blobs' own.
    """
    joined = b"".join(blobs)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(joined), 1))
    unpacker.feed(joined)
    out = list(unpacker)
    if len(out) != len(blobs):
        raise ValueError(f"{len(blobs)} held blobs read as {len(out)} objects")
    return out


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


# -- what the trainer's store holds per key ------------------------------------------------------

# What the store holds per key: packed tags, or the dict itself.
_Held = Any


def freeze(tags: Tags) -> _Held:
    """``tags`` packed (:func:`pack_tags`), or the dict itself when packing would change them."""
    packed = pack_tags(tags, exact=True)
    return tags if packed is None else packed


def thaw(held: _Held) -> Tags:
    """A fresh dict of the held tags."""
    return unpack_held(held) if type(held) is bytes else copy.deepcopy(held)
