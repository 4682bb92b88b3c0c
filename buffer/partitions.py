"""The store, in the trainer process: what the buffer holds, the ledger of who listed it, and telling the policies.

Sections, in order:

- :class:`Ledger`: pure bookkeeping of what each stream lists, what the trainer removed and whether a view
  is whole; the store calls it under its lock and applies what it decides.
- :class:`PartitionStore`: ``partition -> {key -> tags}`` under one lock, and waiting on it. The trainer
  writes with ``add``/``remove``, the pollers' streams one DELTA at a time (:meth:`PartitionStore.apply`).
  No ZeroMQ and no sampling rules.
- Telling the policies (the store's last methods): each sampling policy (:mod:`buffer.steps`,
  :mod:`buffer.verl.groups`; what one implements is in :mod:`buffer.seam`) keeps its own index, told of
  every change under the lock, in the order attached, in one call per poll where it can; a policy that
  raises fails the store's waits instead of the receiver thread.

Tags are held packed (:func:`~poller.wire.tags.freeze`), a poller's as the bytes they arrived in: the
garbage collector has nothing to traverse (1M keys: a full collection in a few ms, not tens), and a resync
of an unchanged key costs one comparison. Tags msgpack cannot hold exactly (the trainer's tuples) stay
dicts. Partitions keep arrival order.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress, repeat
from operator import and_, eq, is_, itemgetter, le, methodcaller, ne, not_
from typing import TYPE_CHECKING, Any, Concatenate, NamedTuple, ParamSpec, TypeVar

from buffer.errors import BufferClosed
from poller.wire.errors import ProtocolError
from poller.wire.protocol import Delta
from poller.wire.tags import freeze, thaw, thaw_many
from poller.wire.vocabulary import Tags

if TYPE_CHECKING:  # buffer.seam imports this module
    from buffer.seam import Policy

__all__ = ["Ledger", "PartitionStore", "Tags"]

logger = logging.getLogger(__name__)


# -- the ledger ----------------------------------------------------------------------

# stream -> (epoch, a poll number)
Horizon = Mapping[str, tuple[int, int]]
_UNLISTED = object()
# One record of a key as a stream listed it: packed tags (``bytes``) or a dict; compared with ``==``, never read.
Version = Any


class _Tomb(NamedTuple):
    """The trainer removed a key: the removal's horizon, and the versions of it removed."""

    horizon: Horizon
    versions: list[Version]


class Ledger:
    """Listings, snapshots, tombstones, poll horizons and sync answers of every stream.

    A *stream* is what one poller sends, named by its ZeroMQ identity. Pure bookkeeping (no tags, locks,
    policies or sockets); ``tests/test_ledger.py`` checks it, through the store, against a model.

    A key the trainer removed while a poll under way still lists it gets a *tombstone*, which hides the
    record *as removed* (the versions each stream listed and the store held), never the name: the same
    version listed again stays hidden; another version is a new record, shown at once if listed by a poll
    begun after the removal, else in doubt until the first complete poll begun after (shown if still listed).
    A tombstone ends when no stream lists the key; a removal of a key no stream lists is *pending* until the
    first complete poll past it that does not list it.

    "Began after" is told by poll numbers, never by clocks: a removal notes per stream the highest poll
    received, ``m`` (its *horizon*); poll ``m + 1`` may be listing already, ``m + 2`` began after it.

    A view is *whole* when the streams it requires (the buffer's own poller) had a first complete poll
    applied and no stream listing the partition is half-way through a full listing or awaiting a resync;
    *fresh* while each required stream answers and its last complete poll is at most ``max_age`` s old (the
    trainer's ``time.monotonic()``). A decision needs both.
    """

    def __init__(self) -> None:
        # stream -> partition -> key that stream lists -> the version it listed last (atomic values:
        # the GC need not traverse it). A partition of which a stream lists no key has no entry.
        self._listed: dict[str, dict[str, dict[str, Version]]] = {}
        # stream -> partitions the full listing being received has listed so far.
        self._snapshots: dict[str, set[str]] = {}
        # stream -> partition -> keys listed before that full listing and not by it yet, crossed off
        # as they come again (1M: ~0.2 s, a set difference ~1 s); what is left at its end has vanished.
        self._unseen: dict[str, dict[str, dict[str, Version]]] = {}
        # Tombstones of keys some stream listed when removed (or since), by partition; of keys none listed.
        self._tomb_listed: dict[str, dict[str, _Tomb]] = {}
        self._tomb_pending: dict[tuple[str, str], _Tomb] = {}
        # (partition, key) of listed tombstones in doubt (a new version, listed by a poll under way).
        self._in_doubt: set[tuple[str, str]] = set()
        # stream -> (epoch, highest poll received any message of); (epoch, poll) of the message being applied.
        self._seen: dict[str, tuple[int, int]] = {}
        self._current: dict[str, tuple[int, int]] = {}
        # stream -> highest sync token a complete poll answered; epoch of its last complete poll.
        self._synced: dict[str, int] = {}
        self._completed_epoch: dict[str, int] = {}
        # Streams every view needs a first complete poll of; stream -> why its next full listing is awaited.
        self._required: set[str] = set()
        self._broken: dict[str, str] = {}
        # Fresh views: when each stream's last complete poll was applied; since when (and why) its
        # store has not answered, until its next complete poll; the oldest a fresh view may be.
        self._completed_at: dict[str, float] = {}
        self._silent: dict[str, tuple[float, str]] = {}
        self._max_age: float | None = None

    # -- the stream -------------------------------------------------------------------

    def poll_seen(self, stream: str, epoch: int, poll: int) -> None:
        """A message of poll ``poll`` of ``stream``'s process ``epoch`` arrived (and is being applied)."""
        self._current[stream] = (epoch, poll)
        seen = self._seen.get(stream)
        if seen is None or seen[0] != epoch or seen[1] < poll:
            self._seen[stream] = (epoch, poll)

    def listed(self, stream: str, partition: str, keys: Sequence[str],
               versions: Sequence[Version]) -> list[str] | None:
        """``stream`` lists ``keys`` at ``versions``; the keys whose tags to merge (``None``: all of them)."""
        listed = self._listed.setdefault(stream, {}).setdefault(partition, {})
        snapshot = self._snapshots.get(stream)
        unseen = None
        if snapshot is not None:
            snapshot.add(partition)
            unseen = self._unseen[stream].get(partition)
        if unseen:  # crossed off; only changed versions are written (C-level passes, not 1M pairs again)
            changed = list(map(ne, map(unseen.pop, keys, repeat(None)), versions))
            if any(changed):
                listed.update(zip(compress(keys, changed), compress(versions, changed)))
        else:
            listed.update(zip(keys, versions))
        tombs = self._tomb_listed.get(partition)
        if tombs is None and not self._tomb_pending:  # the common case: no removal in flight
            return None
        current = self._current.get(stream)
        merge = []
        for key, version in zip(keys, versions):
            tomb = tombs.get(key) if tombs is not None else None
            if tomb is None and self._tomb_pending:
                tomb = self._tomb_pending.pop((partition, key), None)
                if tomb is not None:  # listed from now on: it ends when no stream lists it
                    tombs = self._tomb_listed.setdefault(partition, {})
                    tombs[key] = tomb
            if tomb is None:
                merge.append(key)
            elif version in tomb.versions:
                continue  # the record removed, listed again
            elif current is None or not _after(tomb.horizon, stream, *current):
                # A poll under way at the removal listed another version: the next one settles it (settle()).
                self._in_doubt.add((partition, key))
            else:
                assert tombs is not None
                self._end_tomb(partition, key)  # a new record of the removed key's name
                tombs = self._tomb_listed.get(partition)
                merge.append(key)
        return merge

    def unlisted(self, stream: str, partition: str, keys: Iterable[str]) -> list[str]:
        """``stream`` no longer lists ``keys``; the ones to drop (no other source lists them, none removed)."""
        listed = self._listed.get(stream, {}).get(partition)
        unseen = self._unseen.get(stream, {}).get(partition)
        tombs = self._tomb_listed.get(partition)
        drop = []
        for key in list(keys):
            if listed is not None:
                listed.pop(key, None)
            if unseen is not None:
                unseen.pop(key, None)
            if self.is_listed(partition, key):
                continue
            if tombs is not None and key in tombs:
                self._end_tomb(partition, key)  # no source lists it: a later listing of it is new
                tombs = self._tomb_listed.get(partition)
            else:
                drop.append(key)
        if listed is not None and not listed:
            del self._listed[stream][partition]
        return drop

    def _settle(self, stream: str, epoch: int, poll: int) -> list[tuple[str, str, Version]]:
        """The new records a complete poll settles: tombstones in doubt whose key it still lists, not removed."""
        shown = []
        for partition, key in list(self._in_doubt):
            tomb = self._tomb_listed[partition][key]
            if not _after(tomb.horizon, stream, epoch, poll):
                continue
            version = self._listed.get(stream, {}).get(partition, {}).get(key, _UNLISTED)
            if version is _UNLISTED:
                continue  # another stream lists it: that one settles it
            if version in tomb.versions:
                self._in_doubt.discard((partition, key))  # the store holds the record removed: it stays hidden
            else:
                self._end_tomb(partition, key)
                shown.append((partition, key, version))
        return shown

    def _end_tomb(self, partition: str, key: str) -> None:
        tombs = self._tomb_listed[partition]
        del tombs[key]
        if not tombs:
            del self._tomb_listed[partition]
        self._in_doubt.discard((partition, key))

    def begin_snapshot(self, stream: str) -> None:
        """A full listing from ``stream`` starts; what it omits has vanished."""
        self.abandon_snapshot(stream)  # one begun before and never ended: what it listed stays listed
        self._snapshots[stream] = set()
        self._unseen[stream] = {partition: keys.copy() for partition, keys in self._listed.get(stream, {}).items()}

    def _end_snapshot(self, stream: str) -> list[tuple[str, list[str]]]:
        """The full listing is complete: ``(partition, keys)`` to drop, those it did not list."""
        if self._snapshots.pop(stream, None) is None:
            return []
        self._broken.pop(stream, None)
        return [(partition, self.unlisted(stream, partition, list(vanished)))
                for partition, vanished in self._unseen.pop(stream).items() if vanished]

    def abandon_snapshot(self, stream: str) -> None:
        """A full listing was cut short (a gap, a new epoch): what it listed stays listed, and nothing vanished."""
        self._snapshots.pop(stream, None)
        self._unseen.pop(stream, None)

    def poll_completed(self, stream: str, epoch: int, poll: int, *, full: bool, sync: int | None,
                       now: float) -> tuple[list[tuple[str, list[str]]], list[tuple[str, str, Version]], bool]:
        """Poll ``poll`` of ``stream``/``epoch`` was applied whole at ``now``: ``(drops, shown, wake)``: what a
        full poll did not list, the new records it settles, and whether waiters have news (a sync answered, a
        new process's first poll, a view fresh again)."""
        drops = self._end_snapshot(stream) if full else []
        shown = self._settle(stream, epoch, poll)
        last = self._completed_at.get(stream)
        wake = self._silent.pop(stream, None) is not None or (
            self._max_age is not None and last is not None and now - last > self._max_age)
        self._completed_at[stream] = now
        if (sync is not None and sync > self._synced.get(stream, 0)) or self._completed_epoch.get(stream) != epoch:
            # Answered, or a new poller process to ask again.
            self._synced[stream] = max(sync or 0, self._synced.get(stream, 0))
            self._completed_epoch[stream] = epoch
            wake = True
        if self._tomb_pending:
            expired = [pk for pk, tomb in self._tomb_pending.items()
                       if _after(tomb.horizon, stream, epoch, poll) and not self.is_listed(*pk)]
            for pk in expired:
                del self._tomb_pending[pk]
        return drops, shown, wake

    def synced(self, stream: str) -> int:
        """The highest sync token a complete poll of ``stream`` answered (0: none)."""
        return self._synced.get(stream, 0)

    # -- the trainer ------------------------------------------------------------------

    def removed(self, partition: str, held: Mapping[str, Version | None]) -> None:
        """The trainer removed ``held``'s keys (with the version the store held, or None); see the class docstring."""
        horizon = {stream: (epoch, poll + 1) for stream, (epoch, poll) in self._seen.items()}  # shared by the keys
        tombs = self._tomb_listed.get(partition)
        for key, version in held.items():
            versions = [version] if version is not None else []
            versions.extend(listed[key] for parts in self._listed.values()
                            if (listed := parts.get(partition)) is not None and key in listed)
            old = (tombs.get(key) if tombs is not None else None) or self._tomb_pending.get((partition, key))
            if old is not None:  # removed again: what was removed before stays removed
                versions.extend(old.versions)
                self._in_doubt.discard((partition, key))  # a new horizon: the next poll settles it anew
            tomb = _Tomb(horizon, versions)
            if self.is_listed(partition, key):
                if tombs is None:
                    tombs = self._tomb_listed[partition] = {}
                tombs[key] = tomb
            else:
                self._tomb_pending[(partition, key)] = tomb

    def is_listed(self, partition: str, key: str) -> bool:
        """Whether some stream lists ``key`` (in the full listing under way, or in the one before)."""
        return any(key in parts.get(partition, ()) for parts in self._listed.values())

    # -- whole views ------------------------------------------------------------------

    def require(self, stream: str) -> None:
        """No view is whole until a first complete poll of ``stream`` was applied (the buffer's own poller)."""
        self._required.add(stream)

    def mark_broken(self, stream: str, why: str = "lost messages") -> None:
        """``stream``'s stream lost messages; what it lists is not whole until its next full listing ends."""
        self._broken[stream] = why

    def replaced(self, stream: str) -> list[tuple[str, list[str]]]:
        """``stream``'s store was replaced: ``(partition, keys)`` to drop, every key only it listed, removed ones
        too (the new store's keys of those names are new records); not whole until its first full listing ends."""
        self.abandon_snapshot(stream)
        drops = [(partition, self.unlisted(stream, partition, list(keys)))
                 for partition, keys in list(self._listed.get(stream, {}).items())]
        self.mark_broken(stream, "has a new store")
        return drops

    def release(self, stream: str) -> None:
        """Stop waiting for ``stream`` (a standalone poller gone silent or forgotten)."""
        self.abandon_snapshot(stream)
        self._broken.pop(stream, None)

    def bound_age(self, max_age: float) -> None:
        """A view is fresh only while each required stream's last complete poll is at most ``max_age`` s old."""
        self._max_age = max_age

    def not_answering(self, stream: str, since: float, why: str) -> None:
        """``stream``'s store has not answered since ``since`` (an episode's earliest, with its latest ``why``)."""
        first = self._silent.get(stream)
        self._silent[stream] = (since if first is None else min(first[0], since), why)

    def view_stale(self, now: float) -> str | None:
        """Why a whole view is not fresh at ``now`` (the trainer's ``time.monotonic()``); ``None`` if it is."""
        for stream in self._required:
            stale = self._stale(stream, now)
            if stale is not None:
                return stale
        return None

    def view_gap(self, partition: str | None = None) -> str | None:
        """Why the view of ``partition`` (``None``: of every partition) is not whole; ``None`` if it is."""
        for stream in self._required:
            if stream not in self._completed_epoch:
                received = sum(map(len, self._listed.get(stream, {}).values()))
                return (f"the first complete listing of poller {stream} has not been applied yet "
                        f"({received} key(s) of it received so far)")
            if stream in self._snapshots:
                return f"a full listing (resync) of poller {stream} is being applied"
            if stream in self._broken:
                return f"poller {stream} {self._broken[stream]}: its next full listing is awaited"
        for stream in list(self._snapshots) + list(self._broken):
            if stream in self._required:
                continue
            if partition is None or partition in self._snapshots.get(stream, ()) \
                    or partition in self._listed.get(stream, ()):
                what = "being applied" if stream in self._snapshots else f"awaited ({self._broken[stream]})"
                return f"a full listing of poller {stream}, which lists this partition, is {what}"
        return None

    def _stale(self, stream: str, now: float) -> str | None:
        """Why ``stream``'s part of a whole view is not fresh at ``now``; None if it is."""
        completed = self._completed_at.get(stream)
        age = "" if completed is None else f"; its last complete listing was applied {now - completed:.1f}s ago"
        silent = self._silent.get(stream)
        if silent is not None:
            since, why = silent
            return f"the store of poller {stream} has not answered for {now - since:.1f}s ({why}){age}"
        if self._max_age is not None and completed is not None and now - completed > self._max_age:
            return (f"the last complete listing of poller {stream} was applied {now - completed:.1f}s ago, "
                    f"more than max_view_age={self._max_age:g}s")
        return None


def _after(horizon: Horizon, stream: str, epoch: int, poll: int) -> bool:
    """Whether poll ``poll`` of ``stream``/``epoch`` began after a removal (a process unseen then: any past its 1st)."""
    known = horizon.get(stream)
    if known is None or known[0] != epoch:
        return poll > 1
    return poll > known[1]


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

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        #: The trainer's clock, for whether a view is fresh (a simulation gives its own).
        self.clock = clock
        self._cond = threading.Condition(threading.RLock())
        self._parts: dict[str, dict[str, _Held]] = {}
        self._policies: list[Policy] = []
        self._policy_failure: RuntimeError | None = None  # the first error a policy raised
        self.ledger = Ledger()  # read under the lock only
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
        """Merge ``items`` into the partition (``tags.update(new)`` per key)."""
        with self._cond:
            self.check_open()
            for key, tags in items.items():
                self._merge(partition_id, key, tags)
            self._cond.notify_all()

    def remove(self, partition_id: str, keys: Iterable[str]) -> None:
        """Delete keys; a poll still listing them will not bring them back."""
        with self._cond:
            self.check_open()
            items = self._parts.get(partition_id)
            held = {key: items.get(key) if items else None for key in keys}
            for key in held:
                self._drop(partition_id, key)
            self.ledger.removed(partition_id, held)
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

    def apply(self, stream: str, epoch: int, delta: Delta, unpack: Callable[[list[bytes]], list[Tags]], *,
              superseded: bool = False) -> None:
        """Apply one DELTA of ``stream``'s process ``epoch``: its keys, its deletes and, at its ``end``, the poll.

        Tags are unpacked with ``unpack`` only where the store does not hold their bytes already. A
        ``superseded`` DELTA (a resync is awaited) only counts as received: its poll number still bounds a
        removal's horizon.

        Raises:
            ProtocolError: (from ``unpack``) tags the decoder refuses. What came before them is applied: the
                stream is broken until a resync.
        """
        with self._cond:
            ledger = self.ledger
            ledger.poll_seen(stream, epoch, delta.poll)
            if self._closed or superseded:
                return
            if delta.full and delta.reset:
                ledger.begin_snapshot(stream)
            changed = False
            try:
                for partition_id, (keys, blobs) in delta.packed.items():
                    changed = self._merge_packed(stream, partition_id, keys, blobs, unpack) or changed
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
                    self._merge(partition_id, key, thaw(version), blob=version if type(version) is bytes else None)
                changed = changed or wake or bool(shown) or delta.full
            if changed:  # what a waiter could see: keys, a whole view, a sync answered, a new poller
                self._cond.notify_all()

    def _merge_packed(self, stream: str, partition_id: str, keys: Sequence[str], blobs: Sequence[bytes],
                      unpack: Callable[[list[bytes]], list[Tags]]) -> bool:
        """Merge what ``stream`` lists (lock held); True if a key changed. A key whose bytes are held already
        is unchanged, found with no decode (100k unchanged: ~20 ms, not ~100); the others are unpacked first."""
        items = self._parts.get(partition_id)
        olds = list(map(items.get, keys)) if items else [None] * len(keys)
        changed = list(compress(range(len(keys)), map(ne, olds, blobs)))
        decoded = unpack([blobs[i] for i in changed]) if changed else []
        merge = self.ledger.listed(stream, partition_id, keys, blobs)
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
                    self._merge(partition_id, key, tags, blob=blob)
        self._tell_bulk(partition_id, new_keys, None, new_tags)
        return True

    def _replace_packed(self, partition_id: str, items: dict[str, _Held], keys: list[str], old_blobs: list[bytes],
                        blobs: list[bytes], news: list[Tags]) -> None:
        """``_merge`` of keys held packed, all at once in C-level passes (lock held).

        A key whose new tags hold every name of its old ones (a poller lists whole tags) is held as the bytes
        that arrived; the policies are told in one call (:meth:`~buffer.seam.BulkPolicy.on_replaced`).
        """
        olds = thaw_many(old_blobs)
        covered = list(map(le, map(dict.keys, olds), map(dict.keys, news)))
        if all(covered):
            items.update(zip(keys, blobs))
            merged = news
        else:
            merged = []
            for key, old, new, blob, whole in zip(keys, olds, news, blobs, covered):
                if whole:
                    items[key] = blob
                    merged.append(new)
                else:  # a tag the trainer added beside the source's stays (tags.update semantics)
                    current = dict(old)
                    current.update(new)
                    items[key] = freeze(current)
                    merged.append(current)
        self._tell_bulk(partition_id, keys, olds, merged)

    abandon_snapshot = _ledger(Ledger.abandon_snapshot)
    synced = _ledger(Ledger.synced)
    require = _ledger(Ledger.require)
    mark_broken = _ledger(Ledger.mark_broken)
    release = _ledger(Ledger.release, notify=True)
    view_gap = _ledger(Ledger.view_gap)
    bound_age = _ledger(Ledger.bound_age)
    not_answering = _ledger(Ledger.not_answering)

    def replaced(self, stream: str) -> None:
        """``stream``'s store was replaced (a switch): drop what only it listed (:meth:`Ledger.replaced`)."""
        with self._cond:
            for partition_id, keys in self.ledger.replaced(stream):
                for key in keys:
                    self._drop(partition_id, key)
            self._cond.notify_all()

    def view_stale(self) -> str | None:
        """Why a whole view is not fresh now (its store does not answer, or it is too old); None if it is."""
        with self._cond:
            return self.ledger.view_stale(self.clock())

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

    # -- internals (lock held) ----------------------------------------------------

    def _view_gap(self, partition_id: str | None) -> str | None:
        """``"not whole: why"``, ``"not fresh: why"``, or None (lock held)."""
        gap = self.ledger.view_gap(partition_id)
        if gap is not None:
            return f"not whole: {gap}"
        stale = self.ledger.view_stale(self.clock())
        return None if stale is None else f"not fresh: {stale}"

    def _merge(self, partition_id: str, key: str, new: Mapping[str, Any], blob: bytes | None = None) -> None:
        """``tags.update(new)`` for one key; ``blob``: ``new`` as it arrived packed (then ``new`` is ours)."""
        items = self._parts.setdefault(partition_id, {})
        held = items.get(key)
        old: Tags | None = None
        if held is None:  # ``new`` unpacked from ``blob`` for this merge alone needs no copy
            current = new if blob is not None and isinstance(new, dict) else dict(new)
            items[key] = freeze(current) if blob is None else blob
        else:
            current = thaw(held) if type(held) is bytes else held
            if self._policies:
                old = dict(current)
            current.update(new)
            # No tag of the trainer's beside it: keep the arriving bytes, which the next resync compares against.
            items[key] = blob if blob is not None and len(current) == len(new) else freeze(current)
        self._tell_changed(partition_id, key, old if held is not None else None, current)

    def _drop(self, partition_id: str, key: str) -> None:
        items = self._parts.get(partition_id)
        held = items.pop(key, None) if items else None
        if held is None:
            return
        if not items:  # a partition without keys keeps nothing (a partition per step would grow without bound)
            del self._parts[partition_id]
        if self._policies:
            self._tell_changed(partition_id, key, thaw(held), None)

    # -- telling the policies (lock held) -------------------------------------------

    def _tell_changed(self, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        for policy in self._policies:
            self._tell(policy, partition_id, key, old, new)

    def _tell_bulk(self, partition_id: str, keys: list[str], olds: list[Tags] | None, news: list[Tags]) -> None:
        """Tell of many keys' changes (``olds`` None: all added): one ``on_added``/``on_replaced`` call to a
        :class:`~buffer.seam.BulkPolicy` that has it, else ``on_change`` key by key. A policy naming its
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
            method, arguments = (("on_added", (told_news,)) if told_olds is None
                                 else ("on_replaced", (told_olds, told_news)))
            in_bulk = getattr(policy, method, None)
            if in_bulk is None:
                for key, old, new in zip(told, repeat(None) if told_olds is None else told_olds, told_news):
                    self._tell(policy, partition_id, key, old, new)
                continue
            try:
                in_bulk(partition_id, told, *arguments)
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
