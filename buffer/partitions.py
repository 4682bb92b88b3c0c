"""The shared partition store: ``partition -> {key -> tags}`` under one lock, in the trainer process.

No ZeroMQ and no sampling rules: *policies* (:mod:`buffer.policies`, :mod:`buffer.verl.groups`) keep
their own indexes from ``on_change`` and wait with :meth:`PartitionStore.wait_until`. The trainer writes
with ``add``/``remove``, the pollers' streams one DELTA at a time (:meth:`PartitionStore.apply`); the
:class:`~buffer.ledger.Ledger` decides, under the lock, what a listing merges or drops and whether a view
is whole.

Tags are held packed (:func:`~poller.wire.tags.freeze`), a poller's as the bytes they arrived in: the
garbage collector has nothing to traverse (1M keys: a full collection in a few ms, not tens), and a resync
of an unchanged key costs one comparison. Tags msgpack cannot hold exactly (the trainer's tuples) stay
dicts. Partitions keep arrival order.
"""

from __future__ import annotations

import functools
import threading
import time
from itertools import compress, repeat
from operator import is_, le, ne
from typing import Any, Callable, Concatenate, Iterable, Mapping, ParamSpec, Sequence, TypeVar

from buffer.errors import BufferClosed
from buffer.ledger import Ledger
from buffer.policies import AttachedPolicies, Policy
from poller.wire.errors import ProtocolError
from poller.wire.protocol import Delta
from poller.wire.tags import freeze, thaw, thaw_many
from poller.wire.vocabulary import Tags

__all__ = ["PartitionStore", "Tags"]

T = TypeVar("T")
P = ParamSpec("P")
# What the store holds per key: packed tags, or the dict itself (poller.wire.tags.freeze).
_Held = Any


def _kept(mask: Iterable[Any], *columns: Sequence[Any]) -> list[list[Any]]:
    """Each column's entries where ``mask`` is true (in C-level passes)."""
    mask = list(mask)
    return [list(compress(column, mask)) for column in columns]


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

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._parts: dict[str, dict[str, _Held]] = {}
        self._policies = AttachedPolicies()
        self.ledger = Ledger()  # read under the lock only
        self._closed = False
        self._failure: BaseException | None = None

    # -- policies and waiting ---------------------------------------------------

    def attach(self, policy: Policy) -> None:
        """Attach ``policy``; it first sees every key held as an addition."""
        with self._cond:
            self.check_open()
            self._policies.append(policy)
            for partition_id, items in self._parts.items():
                for key, held in items.items():
                    policy.on_change(partition_id, key, None, thaw(held))
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
                failure = self._failure if self._failure is not None else self._policies.failure
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
                                                           sync=delta.sync, now=time.monotonic())
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
            self._policies.added(partition_id, list(keys), decoded)
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
        self._policies.added(partition_id, new_keys, new_tags)
        return True

    def _replace_packed(self, partition_id: str, items: dict[str, _Held], keys: list[str], old_blobs: list[bytes],
                        blobs: list[bytes], news: list[Tags]) -> None:
        """``_merge`` of keys held packed, all at once in C-level passes (lock held).

        A key whose new tags hold every name of its old ones (a poller lists whole tags) is held as the bytes
        that arrived; the policies are told in one call (:meth:`~buffer.policies.BulkPolicy.on_replaced`).
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
        self._policies.replaced(partition_id, keys, olds, merged)

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
            return self.ledger.view_stale(time.monotonic())

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
        stale = self.ledger.view_stale(time.monotonic())
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
        self._policies.changed(partition_id, key, old if held is not None else None, current)

    def _drop(self, partition_id: str, key: str) -> None:
        items = self._parts.get(partition_id)
        held = items.pop(key, None) if items else None
        if held is None:
            return
        if not items:  # a partition without keys keeps nothing (a partition per step would grow without bound)
            del self._parts[partition_id]
        if self._policies:
            self._policies.changed(partition_id, key, thaw(held), None)
