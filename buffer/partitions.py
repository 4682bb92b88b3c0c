"""The shared partition store: ``partition -> {key -> tags}`` under one lock.

Pure in-process state, no ZeroMQ, and no sampling rules: those are *policies*
(:mod:`buffer.steps` for ``ReplayBuffer.sample``, :mod:`buffer.groups` for
verl's groups) that keep their own indexes from :meth:`Policy.on_change`,
called under the lock for every key that changed, and wait for what they need
with :meth:`PartitionStore.wait_until`.

Two kinds of writers feed the store: the trainer (``add``/``remove``) and
sources, through the stream receiver (``merge_listed``/``unlist``/snapshots).
The store keeps, per source, which keys that source currently lists, so it
can tell

* a key that vanished from the store (drop it), from
* a key the trainer removed while a poll already under way still lists it
  (a *tombstone*: ignore that key until the source stops listing it).

A removal of a key no source lists leaves a *pending* tombstone: a poll that
began before the removal may still list the key. Whether a poll began before
the removal is told by the source's poll numbers, never by clocks (the
trainer's and a poller's host may disagree by any amount). At the removal the
store notes, per source, the highest poll it has received any message of,
``m``; poll ``m + 1`` may already be listing, and a poll numbered ``m + 2`` or
later began after poll ``m + 1`` was sent whole, so after the removal unless
the receiver was a whole poll behind its poller. The first *complete* poll
past that horizon that does not list the key ends the pending tombstone.

Tags are held marshalled (``bytes``), and every per-key container maps to
atomic values, so the garbage collector finds nothing to traverse in them: a
full ``gc.collect()`` with 1M keys held is then a few milliseconds, where a
dict of 1M tag dicts costs tens (see ``python -m bench``). Tags marshal cannot
hold (the trainer's own objects in ``add``) stay dicts. Each partition's dict
is in arrival order (a removed key that comes back arrives anew).
"""

from __future__ import annotations

import copy
import logging
import marshal
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Protocol, TypeVar

from .errors import BufferClosed

__all__ = ["PartitionStore", "Policy", "Tags"]

logger = logging.getLogger(__name__)

Tags = dict[str, Any]
# What the store holds per key: marshalled tags, or the dict itself.
_Held = Any
T = TypeVar("T")


class Policy(Protocol):
    """Sampling semantics over a :class:`PartitionStore`: indexes kept from changes."""

    def on_change(self, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        """Called with the store lock held after one key changed (old None: added; new None: dropped).

        Must be cheap and must not call back into the store. Dicts must not be mutated.
        """


def freeze(tags: Tags) -> _Held:
    # Version 2 writes no back-references, so equal dicts built in the same
    # key order give equal bytes (the resync shortcut in _merge).
    try:
        return marshal.dumps(tags, 2)
    except ValueError:
        return tags


def thaw(held: _Held) -> Tags:
    """A fresh dict of the held tags."""
    return marshal.loads(held) if type(held) is bytes else copy.deepcopy(held)


class PartitionStore:
    """Thread-safe ``partition -> {key -> tags}``, source bookkeeping, and waiting.

    The lock is reentrant, so a :meth:`wait_until` attempt may call
    :meth:`get` (or any other reader) while it holds it.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._parts: dict[str, dict[str, _Held]] = {}
        self._policies: list[Policy] = []
        # source id -> partition -> keys that source listed last (a dict of
        # None rather than a set: the GC need not traverse it).
        self._listed: dict[str, dict[str, dict[str, None]]] = {}
        # source id -> partition -> keys seen in the snapshot being received.
        self._snapshots: dict[str, dict[str, set[str]]] = {}
        # Tombstones of keys still listed by some source: cleared by unlist.
        self._tomb_listed: dict[str, set[str]] = {}
        # Tombstones of keys no source listed when removed -> the horizon of
        # the removal: source -> (epoch, last poll that may have begun before it).
        self._tomb_pending: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
        # source id -> (epoch, highest poll number received any message of).
        self._seen: dict[str, tuple[int, int]] = {}
        # source id -> highest sync token a complete poll of it answered, and
        # the epoch of its last complete poll.
        self._synced: dict[str, int] = {}
        self._completed_epoch: dict[str, int] = {}
        # Whole views: the sources whose first complete poll every decision
        # needs (the buffer's own poller), and the sources whose stream lost
        # something and awaits a resync (their view is not whole until it ends).
        self._required: set[str] = set()
        self._broken: set[str] = set()
        self._closed = False
        self._failure: BaseException | None = None

    # -- policies and waiting ---------------------------------------------------

    def attach(self, policy: Policy) -> None:
        """Attach ``policy``; it first sees every key held as an addition."""
        with self._cond:
            self._check_open()
            self._policies.append(policy)
            for partition_id, items in self._parts.items():
                for key, held in items.items():
                    policy.on_change(partition_id, key, None, thaw(held))
            self._cond.notify_all()

    def detach(self, policy: Policy) -> None:
        """Stop calling ``policy`` (no-op if it is not attached)."""
        with self._cond:
            if policy in self._policies:
                self._policies.remove(policy)

    def wait_until(self, attempt: Callable[[], T | None], *, timeout: float | None,
                   describe: Callable[[], str], view: str | None = None) -> T:
        """Under the lock: call ``attempt()`` now and after every change until it returns non-None.

        With ``view``, ``attempt`` decides on that partition, and is called
        only while the partition's view is whole (:meth:`view_gap`): no
        answer ever comes from a listing applied half-way.

        Raises:
            ValueError: ``timeout`` is negative or NaN.
            TimeoutError: ``describe()`` as the message, at the deadline.
            PollerCrashed: (the stored failure) the poller is dead for good.
            BufferClosed: the store was closed, possibly while waiting.
        """
        if timeout is not None and not timeout >= 0:  # also refuses NaN
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open()
                if self._failure is not None:
                    raise self._failure
                gap = None if view is None else self._view_gap(view)
                if gap is None:
                    result = attempt()
                    if result is not None:
                        return result
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if gap is not None:
                        raise TimeoutError(f"{describe()}; and no answer was given because the view of partition "
                                           f"{view!r} is not whole: {gap}")
                    raise TimeoutError(describe())
                self._cond.wait(remaining)

    def notify(self) -> None:
        """Wake every waiter to re-run its attempt (for state kept outside the store)."""
        with self._cond:
            self._cond.notify_all()

    def get(self, partition_id: str, keys: Iterable[str]) -> dict[str, Tags]:
        """Copies of the held tags of ``keys`` (keys not held are left out)."""
        with self._cond:
            items = self._parts.get(partition_id)
            if not items:
                return {}
            return {key: thaw(items[key]) for key in keys if key in items}

    # -- trainer side -----------------------------------------------------------

    def add(self, partition_id: str, items: Mapping[str, Mapping[str, Any]]) -> None:
        """Merge ``items`` into the partition (``tags.update(new)`` per key)."""
        with self._cond:
            self._check_open()
            for key, tags in items.items():
                self._merge(partition_id, key, tags)
            self._cond.notify_all()

    def remove(self, partition_id: str, keys: Iterable[str]) -> None:
        """Delete keys; a poll still listing them will not bring them back."""
        with self._cond:
            self._check_open()
            horizon: dict[str, tuple[int, int]] | None = None
            for key in keys:
                self._drop(partition_id, key)
                if self._is_listed(partition_id, key):
                    self._tomb_listed.setdefault(partition_id, set()).add(key)
                else:
                    if horizon is None:  # one per call, shared by its keys
                        horizon = {source: (epoch, poll + 1) for source, (epoch, poll) in self._seen.items()}
                    self._tomb_pending[(partition_id, key)] = horizon
            self._cond.notify_all()

    def snapshot(self, partition_id: str | None = None) -> dict[str, dict[str, Tags]] | dict[str, Tags]:
        """A deep copy of all partitions, or of one (empty if unknown)."""
        with self._cond:
            self._check_open()
            if partition_id is not None:
                items = self._parts.get(partition_id)
                return {k: thaw(v) for k, v in items.items()} if items else {}
            return {pid: {k: thaw(v) for k, v in items.items()} for pid, items in self._parts.items() if items}

    def key_count(self) -> int:
        with self._cond:
            return sum(map(len, self._parts.values()))

    # -- source side (called by the stream receiver) ----------------------------

    def poll_seen(self, source_id: str, epoch: int, poll: int) -> None:
        """A message of poll number ``poll`` of ``source_id``'s process ``epoch`` arrived."""
        with self._cond:
            seen = self._seen.get(source_id)
            if seen is None or seen[0] != epoch or seen[1] < poll:
                self._seen[source_id] = (epoch, poll)

    def merge_listed(self, source_id: str, partition_id: str, items: Mapping[str, Tags]) -> None:
        """Merge what ``source_id`` lists; tombstoned keys are ignored."""
        with self._cond:
            if self._closed:
                return
            listed = self._listed.setdefault(source_id, {}).setdefault(partition_id, {})
            listed.update(dict.fromkeys(items))
            snapshot = self._snapshots.get(source_id)
            if snapshot is not None:
                snapshot.setdefault(partition_id, set()).update(items)
            tomb = self._tomb_listed.get(partition_id)
            resync = snapshot is not None
            if tomb is None and not self._tomb_pending:  # the common case: no removal in flight
                for key, tags in items.items():
                    self._merge(partition_id, key, tags, resync)
                self._cond.notify_all()
                return
            for key, tags in items.items():
                if tomb is not None and key in tomb:
                    continue
                if self._tomb_pending and (partition_id, key) in self._tomb_pending:
                    # Listed while the removal is pending: it stays removed
                    # while the source lists it.
                    del self._tomb_pending[(partition_id, key)]
                    tomb = self._tomb_listed.setdefault(partition_id, set())
                    tomb.add(key)
                    continue
                self._merge(partition_id, key, tags, resync)
            self._cond.notify_all()

    def unlist(self, source_id: str, partition_id: str, keys: Iterable[str]) -> None:
        """``source_id`` no longer lists ``keys``: drop them unless another source does."""
        with self._cond:
            if self._closed:
                return
            self._unlist(source_id, partition_id, keys)
            self._cond.notify_all()

    def begin_snapshot(self, source_id: str) -> None:
        """A full listing from ``source_id`` starts; what it omits has vanished."""
        with self._cond:
            self._snapshots[source_id] = {}

    def end_snapshot(self, source_id: str) -> None:
        """The full listing is complete: unlist what it did not contain."""
        with self._cond:
            seen = self._snapshots.pop(source_id, None)
            if seen is None or self._closed:
                return
            self._broken.discard(source_id)
            for partition_id, listed in list(self._listed.get(source_id, {}).items()):
                kept = seen.get(partition_id, set())
                vanished = [key for key in listed if key not in kept]
                if vanished:
                    self._unlist(source_id, partition_id, vanished)
            self._cond.notify_all()

    def abandon_snapshot(self, source_id: str) -> None:
        """A snapshot was cut short (gap, new epoch): forget what it saw."""
        with self._cond:
            self._snapshots.pop(source_id, None)

    def poll_completed(self, source_id: str, epoch: int, poll: int, sync: int | None = None) -> None:
        """Poll ``poll`` of ``source_id``'s process ``epoch`` has been applied whole.

        ``sync`` is the highest sync token the poller had received when the
        poll's listing began.
        """
        with self._cond:
            if (sync is not None and sync > self._synced.get(source_id, 0)) \
                    or self._completed_epoch.get(source_id) != epoch:
                # Wakes sync() waiters: answered, or a new poller process to ask again.
                self._synced[source_id] = max(sync or 0, self._synced.get(source_id, 0))
                self._completed_epoch[source_id] = epoch
                self._cond.notify_all()
            if not self._tomb_pending:
                return
            expired = [pk for pk, horizon in self._tomb_pending.items()
                       if _after(horizon, source_id, epoch, poll) and not self._is_listed(*pk)]
            for pk in expired:
                del self._tomb_pending[pk]

    def require(self, source_id: str) -> None:
        """No view is whole until a first complete poll of ``source_id`` was applied (the buffer's own poller)."""
        with self._cond:
            self._required.add(source_id)

    def mark_broken(self, source_id: str) -> None:
        """``source_id``'s stream lost messages; what it lists is not whole until its next snapshot ends."""
        with self._cond:
            self._broken.add(source_id)

    def release(self, source_id: str) -> None:
        """Stop waiting for ``source_id`` (a standalone poller gone silent or forgotten); it resyncs if it returns."""
        with self._cond:
            self._snapshots.pop(source_id, None)
            self._broken.discard(source_id)
            self._cond.notify_all()

    def view_gap(self, partition_id: str | None = None) -> str | None:
        """Why the view of ``partition_id`` (``None``: of every partition) is not whole now; ``None`` if it is.

        Whole means every key reflects complete listings: the buffer's own
        poller has had a first complete poll applied, and no source that
        lists the partition is half-way through a snapshot or awaiting a
        resync after a loss.
        """
        with self._cond:
            return self._view_gap(partition_id)

    def _view_gap(self, partition_id: str | None) -> str | None:
        for source in self._required:
            if source not in self._completed_epoch:
                received = sum(map(len, self._listed.get(source, {}).values()))
                return (f"the first complete listing of poller {source} has not been applied yet "
                        f"({received} key(s) of it received so far)")
            if source in self._snapshots:
                return f"a full listing (resync) of poller {source} is being applied"
            if source in self._broken:
                return f"the stream of poller {source} lost messages and a resync is awaited"
        for source in list(self._snapshots) + list(self._broken):
            if source in self._required:
                continue
            if partition_id is None or partition_id in self._snapshots.get(source, ()) \
                    or partition_id in self._listed.get(source, ()):
                what = "being applied" if source in self._snapshots else "awaited after a loss"
                return f"a full listing of poller {source}, which lists this partition, is {what}"
        return None

    def synced(self, source_id: str) -> int:
        """The highest sync token a complete poll of ``source_id`` answered (0: none)."""
        with self._cond:
            return self._synced.get(source_id, 0)

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
        self._check_open()

    # -- internals (lock held) ----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosed("the replay buffer is closed")

    def _is_listed(self, partition_id: str, key: str) -> bool:
        return any(key in parts.get(partition_id, ()) for parts in self._listed.values())

    def _unlist(self, source_id: str, partition_id: str, keys: Iterable[str]) -> None:
        listed = self._listed.get(source_id, {}).get(partition_id)
        tomb = self._tomb_listed.get(partition_id)
        for key in list(keys):
            if listed is not None:
                listed.pop(key, None)
            if self._is_listed(partition_id, key):
                continue
            if tomb is not None and key in tomb:
                tomb.discard(key)  # the source stopped listing it: new again
            else:
                self._drop(partition_id, key)

    def _merge(self, partition_id: str, key: str, new: Mapping[str, Any], resync: bool = False) -> None:
        items = self._parts.get(partition_id)
        if items is None:
            items = self._parts[partition_id] = {}
        held = items.get(key)
        old: Tags | None = None
        if held is None:
            current = dict(new)
        else:
            # During a snapshot most tags come back unchanged: equal bytes
            # (0.3 us) skip the thaw and re-freeze (1 us). A delta changed them.
            if resync and type(new) is dict and freeze(new) == held:
                return
            current = marshal.loads(held) if type(held) is bytes else held
            if self._policies:
                old = dict(current)
            current.update(new)
        items[key] = freeze(current)
        for policy in self._policies:
            self._tell(policy, partition_id, key, old if held is not None else None, current)

    def _drop(self, partition_id: str, key: str) -> None:
        items = self._parts.get(partition_id)
        held = items.pop(key, None) if items else None
        if held is None:
            return
        if self._policies:
            old = thaw(held)
            for policy in self._policies:
                self._tell(policy, partition_id, key, old, None)

    def _tell(self, policy: Policy, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        try:
            policy.on_change(partition_id, key, old, new)
        except Exception as exc:
            # A policy bug must not kill the receiver thread (which would leave
            # every wait hanging): it fails the store, and waiters see it.
            logger.exception("policy %r failed on %r/%r", policy, partition_id, key)
            error = RuntimeError(f"sampling policy {type(policy).__name__} failed: {exc!r}")
            error.__cause__ = exc
            self._failure = self._failure or error


def _after(horizon: Mapping[str, tuple[int, int]], source_id: str, epoch: int, poll: int) -> bool:
    """Whether poll ``poll`` of ``source_id``/``epoch`` began after the removal with ``horizon``.

    A process unseen at the removal (new source, restarted poller) may have
    had its first poll under way then.
    """
    known = horizon.get(source_id)
    if known is None or known[0] != epoch:
        return poll > 1
    return poll > known[1]
