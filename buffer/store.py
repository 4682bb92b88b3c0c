"""The store, in the trainer process: what the buffer holds, and telling the policies.

Sections, in order:

- :class:`PartitionStore`: ``partition -> {key -> tags}`` under one lock, and waiting on it. The trainer
  writes with ``add``/``remove``, the pollers' streams one DELTA at a time (:meth:`PartitionStore.apply`).
  No ZeroMQ and no sampling rules. Who lists what, what the trainer removed and whether a view is whole and
  fresh is its :class:`~buffer.ledger.Ledger`'s to decide, called under the lock.
- Telling the policies (the store's last methods): each sampling policy (:mod:`buffer.steps`,
  :mod:`buffer.verl.groups`; what one implements is in :mod:`buffer.sampling`) keeps its own index, told of
  every change under the lock, in the order attached, in one call per poll where it can; a policy that
  raises fails the store's waits instead of the receiver thread.

Tags are held packed (:func:`~poller.wire.tags.freeze`), a poller's as the bytes they arrived in: the
garbage collector has nothing to traverse (1M keys: a full collection in a few ms, not tens), and a resync
of an unchanged key costs one comparison. Tags msgpack cannot hold exactly (the trainer's tuples) stay
dicts. Partitions keep arrival order. A key's tags are what its stream last listed, plus the tags the trainer
``add()``-ed that the listing does not name: a tag the store no longer holds is not kept.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress, repeat
from operator import and_, eq, is_, itemgetter, methodcaller, ne, not_
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from buffer.errors import BufferClosed
from buffer.ledger import Ledger
from poller.wire.errors import ProtocolError
from poller.wire.protocol import DEFAULT_LIMITS, Delta, Limits
from poller.wire.tags import freeze, thaw, thaw_many, unpack_many_tags
from poller.wire.vocabulary import Tags

if TYPE_CHECKING:  # buffer.sampling imports this module
    from buffer.sampling import Policy

__all__ = ["PartitionStore", "Tags"]

logger = logging.getLogger(__name__)


# -- the store -----------------------------------------------------------------------

T = TypeVar("T")
P = ParamSpec("P")
# What the store holds per key: packed tags, or the dict itself (poller.wire.tags.freeze).
_Held = Any


def _kept(mask: Iterable[Any], *columns: Sequence[Any]) -> list[list[Any]]:
    """Each column's entries where ``mask`` is true (in C-level passes)."""
    mask = list(mask)
    return [list(compress(column, mask)) for column in columns]


def _differ(olds: Sequence[Mapping[str, Any]], news: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[bool]:
    """Whether each key's old and new tags differ in any of the tags ``names`` (a tag absent reads ``None``).

    In C-level passes (~0.15 us a key); a value whose ``==`` is not a plain bool marks every key.
    """
    try:
        try:  # every tag present (the usual case): one tuple each
            read = itemgetter(*names)
            return list(map(not_, map(eq, map(read, olds), map(read, news))))
        except KeyError:
            same = [True] * len(olds)
            for name in names:
                get = methodcaller("get", name)
                same = list(map(and_, same, map(bool, map(eq, map(get, olds), map(get, news)))))
            return list(map(not_, same))
    except Exception:
        return [True] * len(olds)


def _with_added(listed: Tags, added: Mapping[str, Any] | None) -> Tags:
    """What a key holds: the tags its stream lists, and those the trainer added that the listing does not name
    (``listed`` itself when there are none)."""
    if not added or added.keys() <= listed.keys():
        return listed
    current = dict(listed)
    current.update((name, value) for name, value in added.items() if name not in listed)
    return current


def _ledger(method: Callable[Concatenate[Ledger, P], T], *,
            notify: bool = False) -> Callable[Concatenate["PartitionStore", P], T]:
    """The store's method that calls its ledger's ``method`` under the lock (the ledger's docstring says what)."""
    @functools.wraps(method)
    def call(store: PartitionStore, *args: P.args, **kwargs: P.kwargs) -> T:
        with store._cond:
            result = method(store.ledger, *args, **kwargs)
            if notify:  # what waiters decide on changed
                store._cond.notify_all()
            return result
    return call


class PartitionStore:
    """Thread-safe ``partition -> {key -> tags}``, stream bookkeeping, and waiting. The lock is reentrant: a
    :meth:`wait_until` attempt may call any reader."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, limits: Limits = DEFAULT_LIMITS) -> None:
        #: The trainer's clock, for whether a view is fresh (a simulation gives its own).
        self.clock = clock
        #: The receiver's decoding bounds: what arrives packed is unpacked within them.
        self.limits = limits
        self._cond = threading.Condition(threading.RLock())
        self._parts: dict[str, dict[str, _Held]] = {}
        self._policies: list[Policy] = []
        self._policy_failure: RuntimeError | None = None  # the first error a policy raised
        self.ledger = Ledger()  # read under the lock only
        #: Told each removal's token under the lock (it must not block): the receiver hands it to the pollers.
        self.on_removed: Callable[[int], None] = lambda token: None
        # partition -> key -> the tags the trainer add()-ed to it: kept beside what its stream lists.
        self._added: dict[str, dict[str, dict[str, Any]]] = {}
        self._closed = False
        self._failure: BaseException | None = None

    # -- policies and waiting ---------------------------------------------------

    def attach(self, policy: Policy) -> None:
        """Attach ``policy``; it first sees every key held as an addition (a partition in one ``on_added``
        call where it has one). What it raises meanwhile reaches the caller."""
        with self._cond:
            self.check_open()
            self._policies.append(policy)
            in_bulk = getattr(policy, "on_added", None)
            for partition_id, items in self._parts.items():
                held = list(items.values())
                tags = thaw_many(held) if set(map(type, held)) <= {bytes} else list(map(thaw, held))
                if in_bulk is not None:
                    in_bulk(partition_id, list(items), tags)
                    continue
                for key, one in zip(items, tags):
                    policy.on_change(partition_id, key, None, one)
            self._cond.notify_all()

    def wait_until(self, attempt: Callable[[], T | None], *, timeout: float | None,
                   describe: Callable[[], str], view: str | None = None) -> T:
        """Under the lock: call ``attempt()`` now and after every change until it returns non-None.

        With ``view``, ``attempt`` decides on that partition and is called only while its view is whole and
        fresh (:meth:`view_gap`). ``timeout`` was checked by the public method that waits.

        Raises:
            TimeoutError: ``describe()`` as the message, at the deadline.
            PollerCrashed: (the stored failure) the poller is dead for good.
            BufferClosed: the store was closed, possibly while waiting.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self.check_open()
                # What fail() was given (the poller is dead for good) outranks a policy's error.
                failure = self._failure if self._failure is not None else self._policy_failure
                if failure is not None:
                    raise failure
                gap = None if view is None else self._view_gap(view)
                if gap is None:
                    result = attempt()
                    if result is not None:
                        return result
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if gap is not None:
                        raise TimeoutError(f"{describe()}; and no answer was given because the view of partition "
                                           f"{view!r} is {gap}")
                    raise TimeoutError(describe())
                self._cond.wait(remaining)

    def read(self, read: Callable[[], T]) -> T:
        """``read()`` under the lock (it must not block)."""
        with self._cond:
            return read()

    def get(self, partition_id: str, keys: Iterable[str]) -> dict[str, Tags]:
        """Copies of the held tags of ``keys`` (keys not held are left out)."""
        with self._cond:
            items = self._parts.get(partition_id, {})
            return {key: thaw(items[key]) for key in keys if key in items}

    # -- trainer side -----------------------------------------------------------

    def add(self, partition_id: str, items: Mapping[str, Mapping[str, Any]]) -> None:
        """Merge ``items`` into the partition (``tags.update(new)`` per key); a later listing of a key keeps the
        tags added here that it does not name."""
        with self._cond:
            self.check_open()
            added = self._added.setdefault(partition_id, {})
            for key, tags in items.items():
                added.setdefault(key, {}).update(tags)
                self._merge(partition_id, key, tags)
            self._cond.notify_all()

    def remove(self, partition_id: str, keys: Iterable[str], cleared: bool = False) -> None:
        """Delete keys; a poll still listing them will not bring them back. ``cleared``: the caller cleared them in
        the store first, so a poll that began after this shows them again if listed (they were put again)."""
        with self._cond:
            self.check_open()
            items = self._parts.get(partition_id)
            held = {key: items.get(key) if items else None for key in keys}
            for key in held:
                self._drop(partition_id, key)
            token = self.ledger.removed(partition_id, held, cleared)
            if token is not None:
                self.on_removed(token)
            self._cond.notify_all()

    def snapshot(self, partition_id: str | None = None) -> dict[str, dict[str, Tags]] | dict[str, Tags]:
        """A deep copy of all partitions, or of one (empty if unknown)."""
        with self._cond:
            self.check_open()
            if partition_id is not None:
                return {k: thaw(v) for k, v in self._parts.get(partition_id, {}).items()}
            return {pid: {k: thaw(v) for k, v in items.items()} for pid, items in self._parts.items() if items}

    def key_count(self) -> int:
        with self._cond:
            return sum(map(len, self._parts.values()))

    # -- source side (called by the stream receiver) ----------------------------

    def apply(self, stream: str, epoch: int, delta: Delta, *, superseded: bool = False) -> None:
        """Apply one DELTA of ``stream``'s process ``epoch``: its keys, its deletes and, at its ``end``, the poll.

        Tags are unpacked (within :attr:`limits`) only where the store does not hold their bytes already. A
        ``superseded`` DELTA (a resync is awaited) only counts as received: its poll number still bounds a
        removal's horizon.

        Raises:
            ProtocolError: tags the decoder refuses. What came before them is applied: the
                stream is broken until a resync.
        """
        with self._cond:
            ledger = self.ledger
            ledger.poll_seen(stream, epoch, delta.poll, delta.sync)
            if self._closed or superseded:
                return
            if delta.full and delta.reset:
                ledger.begin_snapshot(stream)
            changed = False
            try:
                for partition_id, (keys, blobs) in delta.packed.items():
                    changed = self._merge_packed(stream, partition_id, keys, blobs) or changed
            except ProtocolError as exc:
                ledger.abandon_snapshot(stream)
                ledger.mark_broken(stream)
                self._cond.notify_all()
                raise ProtocolError(f"{exc} (key of partition {partition_id!r})") from exc
            for partition_id, keys in delta.deletes.items():
                for key in ledger.unlisted(stream, partition_id, keys):
                    self._drop(partition_id, key)
                    changed = True
            if delta.end:  # the poll was applied whole: a snapshot's vanished keys go, settled records show
                drops, shown, wake = ledger.poll_completed(stream, epoch, delta.poll, full=delta.full,
                                                           sync=delta.sync, now=self.clock())
                for partition_id, keys in drops:
                    for key in keys:
                        self._drop(partition_id, key)
                for partition_id, key, version in shown:
                    self._take_listed(partition_id, key, thaw(version), version if type(version) is bytes else None)
                changed = changed or wake or bool(shown) or delta.full
            if changed:  # what a waiter could see: keys, a whole view, a sync answered, a new poller
                self._cond.notify_all()

    def _merge_packed(self, stream: str, partition_id: str, keys: Sequence[str], blobs: Sequence[bytes]) -> bool:
        """Merge what ``stream`` lists (under the lock); True if a key changed. A key whose bytes are held already
        is unchanged, found with no decode (100k unchanged: ~20 ms, not ~100); the others are unpacked first."""
        items = self._parts.get(partition_id)
        olds = list(map(items.get, keys)) if items else [None] * len(keys)
        changed = list(compress(range(len(keys)), map(ne, olds, blobs)))
        decoded = unpack_many_tags([blobs[i] for i in changed], self.limits) if changed else []
        merge, hidden = self.ledger.listed(stream, partition_id, keys, blobs)
        # What the view showed of these, no stream lists now: dropped last (a partition emptied goes with its dict).
        took = self._take_changed(partition_id, items, keys, olds, blobs, changed, decoded, merge)
        for key in hidden:
            self._drop(partition_id, key)
        return took or bool(hidden)

    def _take_changed(self, partition_id: str, items: dict[str, _Held] | None, keys: Sequence[str],
                      olds: list[Any], blobs: Sequence[bytes], changed: list[int], decoded: list[Tags],
                      merge: list[str] | None) -> bool:
        """The rest of :meth:`_merge_packed`: the ``changed`` keys taken (``merge``: only those), bulk first."""
        if not changed:
            return False
        if items is None:
            items = self._parts[partition_id] = {}
        if merge is None and len(changed) == len(keys) and not any(olds):
            # Every key new (a first snapshot): stored and told in C-level passes.
            items.update(zip(keys, blobs))
            self._tell_bulk(partition_id, list(keys), None, decoded)
            return True
        # The changed keys, with what the store held of each, their bytes and their tags.
        columns: list[list[Any]] = [list(map(keys.__getitem__, changed)), list(map(olds.__getitem__, changed)),
                                    list(map(blobs.__getitem__, changed)), decoded]
        if merge is not None:  # a removal in flight: its keys stay removed
            columns = _kept(map(set(merge).__contains__, columns[0]), *columns)
        kinds = list(map(type, columns[1]))
        new_keys, _, new_blobs, new_tags = _kept(map(is_, kinds, repeat(type(None))), *columns)
        items.update(zip(new_keys, new_blobs))
        packed = list(map(is_, kinds, repeat(bytes)))
        if any(packed):
            self._replace_packed(partition_id, items, *_kept(packed, *columns))
        if len(new_keys) + packed.count(True) < len(kinds):  # the trainer's own tags, held as dicts
            for key, old, blob, tags in zip(*columns):
                if old is not None and type(old) is not bytes:
                    self._take_listed(partition_id, key, tags, blob)
        self._tell_bulk(partition_id, new_keys, None, new_tags)
        return True

    def _replace_packed(self, partition_id: str, items: dict[str, _Held], keys: list[str], old_blobs: list[bytes],
                        blobs: list[bytes], news: list[Tags]) -> None:
        """:meth:`_take_listed` of keys held packed, all at once in C-level passes (under the lock).

        A key the trainer added no tag to is held as the bytes that arrived; a policy hears of a key only where a tag
        it reads changed (:attr:`~buffer.sampling.BulkPolicy.indexed_tags`).
        """
        olds = thaw_many(old_blobs)
        added = self._added.get(partition_id)
        if not added or added.keys().isdisjoint(keys):
            items.update(zip(keys, blobs))
            merged = news
        else:
            merged = []
            for key, new, blob in zip(keys, news, blobs):
                current = _with_added(new, added.get(key))
                items[key] = blob if current is new else freeze(current)
                merged.append(current)
        self._tell_bulk(partition_id, keys, olds, merged)

    abandon_snapshot = _ledger(Ledger.abandon_snapshot)
    announce = _ledger(Ledger.announce)
    issue_token = _ledger(Ledger.issue_token)
    lonely = _ledger(Ledger.lonely)
    unvouched = _ledger(Ledger.unvouched)
    synced = _ledger(Ledger.synced)
    require = _ledger(Ledger.require)
    mark_broken = _ledger(Ledger.mark_broken)
    release = _ledger(Ledger.release, notify=True)
    view_gap = _ledger(Ledger.view_gap)
    bound_age = _ledger(Ledger.bound_age)
    not_answering = _ledger(Ledger.not_answering, notify=True)

    def replaced(self, stream: str) -> None:
        """``stream``'s store was replaced (a switch): drop what only it listed (:meth:`Ledger.replaced`)."""
        with self._cond:
            self._drop_all(self.ledger.replaced(stream))

    def withdraw(self, stream: str) -> int:
        """``stream`` is gone for good: drop what only it listed (:meth:`Ledger.withdraw`); how many keys."""
        with self._cond:
            return self._drop_all(self.ledger.withdraw(stream))

    def _drop_all(self, drops: list[tuple[str, list[str]]]) -> int:
        for partition_id, keys in drops:
            for key in keys:
                self._drop(partition_id, key)
        self._cond.notify_all()
        return sum(len(keys) for _, keys in drops)

    def view_stale(self, partition_id: str | None = None) -> str | None:
        """Why a whole view (of ``partition_id``; None: of all) is not fresh now: a store does not answer, a
        view too old, keys only a silent poller lists; None if it is."""
        with self._cond:
            return self.ledger.view_stale(self.clock(), partition_id)

    # -- lifecycle ----------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """Make every current and future wait raise ``error``."""
        with self._cond:
            self._failure = error
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter with :class:`BufferClosed`; later calls raise it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        """Raise :class:`BufferClosed` once closed."""
        if self._closed:
            raise BufferClosed("the replay buffer is closed")

    # -- internals (under the lock) ----------------------------------------------------

    def _view_gap(self, partition_id: str | None) -> str | None:
        """``"not whole: why"``, ``"not fresh: why"``, or None (under the lock)."""
        gap = self.ledger.view_gap(partition_id)
        if gap is not None:
            return f"not whole: {gap}"
        stale = self.ledger.view_stale(self.clock(), partition_id)
        return None if stale is None else f"not fresh: {stale}"

    def _merge(self, partition_id: str, key: str, new: Mapping[str, Any]) -> None:
        """The trainer's ``tags.update(new)`` for one key."""
        items = self._parts.setdefault(partition_id, {})
        held = items.get(key)
        old: Tags | None = None
        if held is None:
            current = dict(new)
        else:
            current = thaw(held) if type(held) is bytes else held
            if self._policies:
                old = dict(current)
            current.update(new)
        items[key] = freeze(current)
        self._tell_changed(partition_id, key, old, current)

    def _take_listed(self, partition_id: str, key: str, new: Tags, blob: bytes | None) -> None:
        """A stream lists ``key`` with tags ``new`` (``blob``: as they arrived packed; ``new`` is then ours): they
        replace what is held, the tags the trainer added that they do not name aside."""
        items = self._parts.setdefault(partition_id, {})
        held = items.get(key)
        old = None if held is None or not self._policies else thaw(held)
        current = _with_added(new, self._added.get(partition_id, {}).get(key))
        items[key] = blob if blob is not None and current is new else freeze(current)
        self._tell_changed(partition_id, key, old, current)

    def _drop(self, partition_id: str, key: str) -> None:
        added = self._added.get(partition_id)
        if added is not None and added.pop(key, None) is not None and not added:
            del self._added[partition_id]
        items = self._parts.get(partition_id)
        held = items.pop(key, None) if items else None
        if held is None:
            return
        if not items:  # a partition without keys keeps nothing (a partition per step would grow without bound)
            del self._parts[partition_id]
        if self._policies:
            self._tell_changed(partition_id, key, thaw(held), None)

    # -- telling the policies (under the lock) -------------------------------------------

    def _tell_changed(self, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        for policy in self._policies:
            self._tell(policy, partition_id, key, old, new)

    def _tell_bulk(self, partition_id: str, keys: list[str], olds: list[Tags] | None, news: list[Tags]) -> None:
        """Tell of many keys' changes (``olds`` None: all added): one ``on_added`` call for additions to a
        :class:`~buffer.sampling.BulkPolicy` that has it, else ``on_change`` key by key. A policy naming its
        ``indexed_tags`` hears of a held key only where one of them changed."""
        if not keys:
            return
        for policy in self._policies:
            told, told_olds, told_news = keys, olds, news
            names = None if olds is None else getattr(policy, "indexed_tags", None)
            if names is not None:  # the keys whose indexed tags kept their values change nothing it holds
                assert olds is not None
                told, told_olds, told_news = _kept(_differ(olds, news, names), keys, olds, news)
                if not told:
                    continue
            in_bulk = getattr(policy, "on_added", None) if told_olds is None else None
            if in_bulk is None:
                for key, old, new in zip(told, repeat(None) if told_olds is None else told_olds, told_news):
                    self._tell(policy, partition_id, key, old, new)
                continue
            try:
                in_bulk(partition_id, told, told_news)
            except Exception as exc:
                self._policy_failed(policy, partition_id, told[0], exc)

    def _tell(self, policy: Policy, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        try:
            policy.on_change(partition_id, key, old, new)
        except Exception as exc:
            self._policy_failed(policy, partition_id, key, exc)

    def _policy_failed(self, policy: Policy, partition_id: str, key: str, exc: Exception) -> None:
        logger.error("policy %r failed on %r/%r", policy, partition_id, key, exc_info=exc)
        error = RuntimeError(f"sampling policy {type(policy).__name__} failed: {exc!r}")
        error.__cause__ = exc
        self._policy_failure = self._policy_failure or error
