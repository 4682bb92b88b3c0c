"""Sources: what the poller lists, and how it builds one from a spec.

A source is any object with ``kv_list()`` returning
``{partition_id: {key: tags}}`` (or ``None`` for "nothing stored").
The poller process builds it itself from an importable spec, so that the
trainer never has to pickle a live store client into the child.

A source whose ``kv_list()`` has a deadline of its own raises
:class:`SourceStall` when the deadline passes: the poller counts a stall and
polls again, instead of treating it as a failure.

A source that can say what changed also implements :class:`ChangeFeed`
(``kv_snapshot()`` and ``kv_changes(cursor)``); the poller then reads only
the changes on each poll, so its work follows the rate of change instead of
the size of the store. The embedded SQLite store does; TransferQueue and the
fault wrappers do not, and are listed in full on every poll.

A source whose store answers in msgpack may also offer ``kv_list_packed()``:
``kv_list()`` with each partition's tags left as the store packed them
(:class:`PackedItems`). The poller then compares each key's packed tags with
the bytes it sent and decodes only those that differ. TransferQueue's does.
A subclass that overrides ``kv_list()`` alone is listed by its ``kv_list()``
(:func:`packed_listing`).

A source without a change feed may offer ``kv_watch(partition_id, keys,
timeout)``: a cheap read of a few named keys returning a :class:`WatchRead`
(a fingerprint that differs once one of them changed, and what it holds of
them, read only when asked for), or ``None`` when it has none to give, answered within
``timeout`` seconds or :class:`SourceStall`.
While a decision waits on those keys the poller calls it every
``watch_interval`` and lists the store as soon as the fingerprint changes
(:mod:`poller.polling`): a schedule that decides *when* to list, never what
the listing shows. TransferQueue's does (``KV_RETRIEVE_META``).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence, Union, runtime_checkable

from poller.wire.vocabulary import Listing

__all__ = ["ChangeFeed", "PackedItems", "Source", "SourceSpec", "SourceStall", "UnreadableValue", "describe_spec",
           "has_change_feed", "load_source", "packed_listing", "WatchRead", "watch_reader"]


class SourceStall(TimeoutError):
    """``kv_list()`` gave up waiting for its store: counted as a stall, not a failure."""


class UnreadableValue:
    """A tag value a source could not turn into a plain one; it stands in the listing in its place.

    The poller quarantines every key whose tags hold one (the key is left out
    of the stream and named with ``reason``), so one such record never fails
    the listing that carries it.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"<unreadable value: {self.reason}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnreadableValue) and other.reason == self.reason

    __hash__ = None  # type: ignore[assignment]  # compared, never hashed


class PackedItems:
    """One partition of a listing, ``{key: packed tags}``, as a store's reply carried it; ``decode`` reads them.

    What ``kv_list_packed()`` puts where ``kv_list()`` puts ``{key: tags}``.
    Every key is a ``str``. Each value is the msgpack of one key's tags,
    and ``decode(blobs)`` returns the tags of each (what ``kv_list()`` would
    have listed; it raises what ``kv_list()`` raises for a malformed reply).
    Bytes equal to those the poller sent for the key mean the tags did not
    change, and they are not decoded: the poller packs tags as msgpack does
    by default (``use_bin_type``), and a store that packs plain values the
    same way saves a decode and a pack per unchanged key. Tags packed any
    other way (an extension type, another encoder) are decoded and compared
    as tags, so the result is the same either way.
    """

    __slots__ = ("items", "decode")

    def __init__(self, items: dict[str, bytes], decode: Callable[[list[bytes]], list[Any]]) -> None:
        self.items = items
        self.decode = decode

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"<PackedItems: {len(self.items)} keys>"

    def decoded(self) -> dict[str, Any]:
        """``{key: tags}``, every key decoded."""
        return dict(zip(self.items, self.decode(list(self.items.values()))))


@runtime_checkable
class Source(Protocol):
    """What the poller needs from a key-value store."""

    def kv_list(self) -> Mapping[str, Mapping[str, Mapping[str, Any]]] | None:
        """Everything currently stored, as ``{partition_id: {key: tags}}``."""
        ...




@runtime_checkable
class ChangeFeed(Protocol):
    """The optional capability of a :class:`Source` that knows what changed since a cursor.

    A cursor is an opaque value the source hands out and takes back. Both
    methods may raise :class:`SourceStall` like ``kv_list()``.

    A source may also offer ``kv_snapshot_pieces() -> (cursor, iterator)``:
    the same snapshot as an iterator of listings, each read only when it is
    taken, from one consistent read that lasts until the iterator is
    exhausted or closed (:meth:`~poller.sources.sqlite.SqliteSource.kv_snapshot_pieces`).
    The poller then sends each piece while the next is read.
    """

    def kv_snapshot(self) -> tuple[Any, Listing]:
        """``(cursor, listing)``: a consistent full listing (as ``kv_list()``) and the cursor right after it.

        Every change committed after the listing was read must come back from
        ``kv_changes(cursor)``.
        """
        ...

    def kv_changes(self, cursor: Any) -> tuple[Any, Listing, dict[str, list[str]]] | None:
        """``(cursor, upserts, deletes)`` since ``cursor``, or ``None`` to ask for a full listing.

        ``upserts`` is ``{partition_id: {key: tags}}`` with the current tags
        of every key written since ``cursor`` (it may hold keys whose tags
        did not change); ``deletes`` is ``{partition_id: [key, ...]}`` of keys
        removed since then and not stored now (a key deleted and put again
        is an upsert). The returned cursor follows exactly these changes.
        ``None``: the cursor can no longer be served (too old, or from a store
        that was replaced or rolled back to a backup: a cursor must tell the
        history it was taken on from another that reached the same count);
        the caller takes :meth:`kv_snapshot`. A key or partition id that is
        not a ``str`` is the record's problem, not the answer's: an upsert
        of one is quarantined, a delete of one lets it out of the quarantine.
        """
        ...


def packed_listing(source: object) -> Callable[[], Any] | None:
    """``source.kv_list_packed`` if the poller should list ``source`` by it, else None.

    Only where the ``kv_list()`` in effect is the one it stands for: a
    subclass that overrides ``kv_list()`` (to log, filter or add to a
    listing) without overriding ``kv_list_packed()`` too is listed by its
    own ``kv_list()``.
    """
    packed = getattr(source, "kv_list_packed", None)
    if not callable(packed) or "kv_list" in getattr(source, "__dict__", ()):
        return None
    mro = type(source).__mro__
    list_owner = next((cls for cls in mro if "kv_list" in vars(cls)), None)
    packed_owner = next((cls for cls in mro if "kv_list_packed" in vars(cls)), None)
    if list_owner is None or packed_owner is None or mro.index(list_owner) < mro.index(packed_owner):
        return None
    return packed  # type: ignore[no-any-return]


def has_change_feed(source: object) -> bool:
    """Whether ``source`` offers :class:`ChangeFeed` (both methods callable)."""
    return callable(getattr(source, "kv_snapshot", None)) and callable(getattr(source, "kv_changes", None))


#: ``"package.module:attr"``, or a picklable callable returning a Source.
SourceSpec = Union[str, Callable[..., Any]]


def _resolve(spec: str) -> Any:
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"source spec {spec!r} is not of the form 'package.module:attr'")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"source spec {spec!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    return obj


def load_source(spec: SourceSpec, kwargs: Mapping[str, Any] | None = None) -> Source:
    """Build a source from ``spec``.

    ``spec`` names (or is) either an object that already has ``kv_list`` —
    used as it is — or a callable, called with ``**kwargs``, whose result must
    have ``kv_list``.

    Raises:
        ValueError: malformed spec, missing attribute, or kwargs given for an
            object that is not called.
        TypeError: the result has no callable ``kv_list``.
        Exception: whatever importing the module or calling the factory raised.
    """
    target = _resolve(spec) if isinstance(spec, str) else spec
    kwargs = dict(kwargs or {})
    # A class has a kv_list attribute too (the unbound function), so "already
    # a source" means: has kv_list and is not itself a class.
    if hasattr(target, "kv_list") and not isinstance(target, type):
        if kwargs:
            raise ValueError(f"source {describe_spec(spec)} is already a source object; it takes no kwargs")
        source = target
    elif callable(target):
        source = target(**kwargs)
    else:
        raise TypeError(f"source {describe_spec(spec)} is neither callable nor an object with kv_list()")
    if not callable(getattr(source, "kv_list", None)):
        raise TypeError(f"source {describe_spec(spec)} gave {type(source).__name__!r}, which has no kv_list()")
    return source


def describe_spec(spec: SourceSpec) -> str:
    """A short, printable name for a spec (for logs and errors)."""
    if isinstance(spec, str):
        return spec
    module = getattr(spec, "__module__", "?")
    name = getattr(spec, "__qualname__", type(spec).__qualname__)
    return f"{module}:{name}"


class WatchRead(NamedTuple):
    """What ``kv_watch(partition_id, keys, timeout)`` read of ``keys``."""

    #: Bytes that differ from one read to the next once a tag, a field or the set of the keys found changed.
    fingerprint: bytes
    #: What the store holds of the keys, read only when called (the poller compares it with what it sent on the
    #: first read after a listing; later reads need the fingerprint alone): how many of them it holds, and each
    #: one's tags when it holds them all and the source can read them (None otherwise).
    held: Callable[[], tuple[int, Union[dict[str, Any], None]]]


#: ``kv_watch(partition_id, keys, timeout)`` (module docstring).
WatchReader = Callable[[str, Sequence[str], float], Union[WatchRead, None]]


def watch_reader(source: Any) -> WatchReader | None:
    """The source's ``kv_watch``, if it offers one and has no change feed (which says what changed already)."""
    if has_change_feed(source):
        return None
    read = getattr(source, "kv_watch", None)
    return read if callable(read) else None
