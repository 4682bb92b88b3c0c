"""The source contract: what a store must and may offer, checked once when the source is loaded.

Both processes use it: the poller builds its source from an importable spec (the trainer never pickles a live
store client into the child), and ``buffer.verl`` builds a store client from the same spec in the trainer.
One :class:`~typing.Protocol` per capability; :func:`capabilities` checks a source once and records what it
offers. Any call may raise :class:`SourceStall` past the source's own deadline (counted, then polled again).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Protocol, Sequence, Union, runtime_checkable

from poller.wire.vocabulary import Listing

__all__ = ["Capabilities", "ChangeFeed", "FieldReads", "PackedItems", "PackedListing", "Source", "SourceSpec",
           "SourceStall", "StoreClient", "Watch", "WatchRead", "WatchReader", "capabilities", "describe_spec",
           "load_source", "resolve_spec"]


class SourceStall(TimeoutError):
    """A source gave up waiting for its store: counted as a stall, not a failure."""


class PackedItems:
    """One partition of ``kv_list_packed()``: ``{key: packed tags}`` as the store's reply carried them.

    ``decode(blobs)`` returns the tags of each (what ``kv_list()`` would list, raising what it raises). Bytes
    equal to those the poller sent for the key (msgpack's default packing) are unchanged tags and stay
    undecoded; tags packed any other way are decoded and compared as tags, with the same result.
    """

    __slots__ = ("items", "decode")

    def __init__(self, items: dict[str, bytes], decode: Callable[[list[bytes]], list[Any]]) -> None:
        self.items = items
        self.decode = decode

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"<PackedItems: {len(self.items)} keys>"


class WatchRead(NamedTuple):
    """What ``kv_watch(partition_id, keys, timeout)`` read of ``keys``."""

    #: Bytes that differ from one read to the next once a tag, a field or the set of the keys found changed.
    fingerprint: bytes
    #: Read only when called (the first read after a listing, compared with what was sent): how many of the keys
    #: the store holds, and each one's tags when it holds them all and the source can read them (None otherwise).
    held: Callable[[], tuple[int, Union[dict[str, Any], None]]]


#: ``kv_watch(partition_id, keys, timeout)``: a :class:`WatchRead`, or None when the store has no fingerprint to give.
WatchReader = Callable[[str, Sequence[str], float], Union[WatchRead, None]]


@runtime_checkable
class Source(Protocol):
    """What the poller needs from a key-value store (required)."""

    def kv_list(self) -> Mapping[str, Mapping[str, Mapping[str, Any]]] | None:
        """Everything currently stored, as ``{partition_id: {key: tags}}``."""
        ...


class PackedListing(Protocol):
    """``kv_list()`` with each partition as :class:`PackedItems`: the poller decodes only changed keys (TransferQueue).

    Used only where it stands for the ``kv_list()`` in effect: a subclass that overrides ``kv_list()`` alone,
    or an instance whose ``kv_list`` was replaced, is listed by its own ``kv_list()``.
    """

    def kv_list_packed(self) -> Mapping[str, Any] | None: ...


@runtime_checkable
class ChangeFeed(Protocol):
    """What changed since a cursor (an opaque value the source hands out and takes back): each poll reads only that.

    A source may also offer ``kv_snapshot_pieces() -> (cursor, iterator)``: :meth:`kv_snapshot` as listings
    each read when taken, from one consistent read held until the iterator is exhausted or closed (the poller
    sends each piece while the next is read). A source with a change feed is not watched.
    """

    def kv_snapshot(self) -> tuple[Any, Listing]:
        """``(cursor, listing)``: a consistent full listing and the cursor right after it.

        Every change committed after the listing must come back from ``kv_changes(cursor)``.
        """
        ...

    def kv_changes(self, cursor: Any) -> tuple[Any, Listing, dict[str, list[str]]] | None:
        """``(cursor, upserts, deletes)`` since ``cursor``, or ``None`` to ask for a full listing.

        ``upserts``: the current tags of every key written since ``cursor`` (possibly unchanged ones); ``deletes``:
        ``{partition_id: [key, ...]}`` removed since then and not stored now (deleted and put again is an upsert).
        The returned cursor follows exactly these changes. ``None``: the cursor can no longer be served (too old,
        or the store was replaced or rolled back to a backup, which a cursor must tell apart): the caller takes
        :meth:`kv_snapshot`. A non-``str`` key or partition id is quarantined (its delete lets it out).
        """
        ...


class Watch(Protocol):
    """A cheap read of named keys, repeated every ``watch_interval`` while a decision waits on them (TransferQueue).

    The poller lists as soon as the fingerprint changes: it decides *when* to list, never what the listing
    shows. Answers within ``timeout`` seconds or raises :class:`SourceStall`.
    """

    def kv_watch(self, partition_id: str, keys: Sequence[str], timeout: float) -> WatchRead | None: ...


class StoreClient(Protocol):
    """The store calls ``buffer.verl`` makes from the trainer: clear keys, and list one partition to check a clear.

    ``clear_is_all_or_nothing = True`` (optional) says a ``kv_clear`` naming a key already gone clears nothing
    (TransferQueue 0.1.8), so every clear is checked by listing the partition.
    """

    def kv_clear(self, keys: list[str], partition_id: str) -> None: ...

    def kv_list(self, partition_id: str | None = None) -> Listing | None: ...


class FieldReads(StoreClient, Protocol):
    """A :class:`StoreClient` that also reads fields (DAPO's metric filter): columns ``{name: [value per key]}``."""

    def kv_batch_get(self, keys: list[str], partition_id: str,
                     select_fields: list[str] | None = None) -> Mapping[str, list[Any]]: ...


class Capabilities(NamedTuple):
    """What one source offers, checked once (:func:`capabilities`): its bound methods, None where not offered.

    A NamedTuple, not a dataclass: the poller process does not import ``dataclasses`` (tests/test_launch.py).
    """

    kv_list: Callable[[], Any]
    #: Only where it stands for the ``kv_list()`` in effect (:class:`PackedListing`).
    kv_list_packed: Callable[[], Any] | None = None
    kv_snapshot: Callable[[], tuple[Any, Listing]] | None = None
    kv_changes: Callable[[Any], Any] | None = None
    kv_snapshot_pieces: Callable[[], tuple[Any, Iterator[Any]]] | None = None
    #: None with a change feed, which says what changed already.
    kv_watch: WatchReader | None = None
    #: ``include_partitions(ids)``: list these partitions too (a source told which partitions it lists).
    include_partitions: Callable[[list[str]], None] | None = None

    @property
    def change_feed(self) -> bool:
        return self.kv_changes is not None


def capabilities(source: object) -> Capabilities:
    """Check ``source`` against the contract and record what it offers.

    Raises:
        TypeError: no callable ``kv_list``; an optional method's name held by something not callable; half a
            change feed (one of ``kv_snapshot``/``kv_changes``, or ``kv_snapshot_pieces`` without both).
    """
    kind = type(source).__name__
    if not callable(getattr(source, "kv_list", None)):
        raise TypeError(f"{kind!r} has no kv_list()")
    offered = {name: getattr(source, name, None) for name in Capabilities._fields[1:]}  # the optional calls
    broken = [name for name, method in offered.items() if method is not None and not callable(method)]
    if broken:
        raise TypeError(f"{kind!r} has {', '.join(broken)}, which is not callable")
    feed = [name for name in ("kv_snapshot", "kv_changes") if offered[name] is not None]
    if len(feed) == 1 or (offered["kv_snapshot_pieces"] is not None and not feed):
        given = [name for name in ("kv_snapshot", "kv_changes", "kv_snapshot_pieces") if offered[name] is not None]
        raise TypeError(f"{kind!r} offers {' and '.join(given)} but a change feed needs kv_snapshot and kv_changes")
    if not _packed_stands_for_list(source):
        offered["kv_list_packed"] = None
    if feed:
        offered["kv_watch"] = None
    return Capabilities(source.kv_list, **offered)  # type: ignore[attr-defined]


def _packed_stands_for_list(source: object) -> bool:
    """Whether the ``kv_list_packed`` in effect is defined at or below the ``kv_list`` in effect (the class order)."""
    if "kv_list" in getattr(source, "__dict__", ()):
        return False
    mro = type(source).__mro__
    list_owner = next((cls for cls in mro if "kv_list" in vars(cls)), None)
    packed_owner = next((cls for cls in mro if "kv_list_packed" in vars(cls)), None)
    return list_owner is not None and packed_owner is not None and mro.index(packed_owner) <= mro.index(list_owner)


#: ``"package.module:attr"``, or a picklable callable returning a Source.
SourceSpec = Union[str, Callable[..., Any]]


def resolve_spec(spec: str) -> Any:
    """The object ``"package.module:attr"`` names, without calling it (the module is imported).

    Raises:
        ValueError: the spec is malformed or the module has no such attribute.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"source spec {spec!r} is not of the form 'package.module:attr'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"source spec {spec!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    return obj


def load_source(spec: SourceSpec, kwargs: Mapping[str, Any] | None = None) -> Source:
    """Build a source from ``spec``, checked against the contract (:func:`capabilities`).

    ``spec`` names (or is) a source (it has ``kv_list``: used as it is) or a factory, called with ``**kwargs``.

    Raises:
        ValueError: malformed spec, missing attribute, or kwargs given for an object that is not called.
        TypeError: the result breaks the contract (:func:`capabilities`).
        Exception: whatever importing the module or calling the factory raised.
    """
    target = resolve_spec(spec) if isinstance(spec, str) else spec
    kwargs = dict(kwargs or {})
    # A class has kv_list too (the unbound function): "already a source" means having kv_list and not being a class.
    if hasattr(target, "kv_list") and not isinstance(target, type):
        if kwargs:
            raise ValueError(f"source {describe_spec(spec)} is already a source object; it takes no kwargs")
        source = target
    elif callable(target):
        source = target(**kwargs)
    else:
        raise TypeError(f"source {describe_spec(spec)} is neither callable nor an object with kv_list()")
    try:
        capabilities(source)
    except TypeError as exc:
        close = getattr(source, "close", None)
        if source is not target and callable(close):
            close()  # built here, refused here: what its constructor opened is not left open
        raise TypeError(f"source {describe_spec(spec)}: {exc}") from None
    return source  # type: ignore[no-any-return]


def describe_spec(spec: SourceSpec) -> str:
    """A short, printable name for a spec (for logs and errors)."""
    if isinstance(spec, str):
        return spec
    module = getattr(spec, "__module__", "?")
    name = getattr(spec, "__qualname__", type(spec).__qualname__)
    return f"{module}:{name}"
