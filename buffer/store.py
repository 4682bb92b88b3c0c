"""The replay store: partitions of ``key -> tags``, and ``sample()``.

Pure in-process state under one lock, no ZeroMQ. Two kinds of writers feed
it: the trainer (``add``/``remove``) and sources, through the stream
receiver (``merge_listed``/``unlist``/snapshots). The store keeps, per
source, which keys that source currently lists, so it can tell

* a key that vanished from the store (drop it), from
* a key the trainer removed while a poll already under way still lists it
  (a *tombstone*: ignore that key until the source stops listing it).

``sample()`` waits on a condition that every change notifies, so it returns
as soon as the data that satisfies it has arrived. Indexes by step and
status keep its checks independent of the partition's size.

Tags are held marshalled (``bytes``), and every per-key container maps to
atomic values, so the garbage collector finds nothing to traverse in them:
a full ``gc.collect()`` with 1M keys held is then a few milliseconds, where
a dict of 1M tag dicts costs tens (see ``python -m bench``). Tags marshal
cannot hold (the trainer's own objects in ``add``) stay dicts.
"""

from __future__ import annotations

import copy
import heapq
import marshal
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple

from .errors import BufferClosed

__all__ = ["BatchMeta", "ReplayStore"]

Tags = dict[str, Any]
# What the store holds per key: marshalled tags, or the dict itself.
_Held = Any

RUNNING = "running"
SUCCESS = "success"

class BatchMeta(NamedTuple):
    """A sampled batch: keys in arrival order and a copy of their tags."""

    partition_id: str
    keys: list[str]
    tags: list[Tags]

def _freeze(tags: Tags) -> _Held:
    # Version 2 writes no back-references, so equal dicts built in the same
    # key order give equal bytes (the resync shortcut in _merge).
    try:
        return marshal.dumps(tags, 2)
    except ValueError:
        return tags


def _thaw(held: _Held) -> Tags:
    """A fresh dict of the held tags."""
    return marshal.loads(held) if type(held) is bytes else copy.deepcopy(held)


def _classify(tags: Mapping[str, Any]) -> tuple[Any, Any]:
    step = tags.get("global_steps")
    # Unhashable steps cannot be indexed and can never equal a requested int.
    try:
        hash(step)
    except TypeError:
        step = None
    return step, tags.get("status")

@dataclass
class _Partition:
    items: dict[str, _Held]
    arrival: dict[str, int]
    running_by_step: dict[Any, set[str]]
    success_by_step: dict[Any, dict[str, int]]
    success: dict[str, int]

    @classmethod
    def empty(cls) -> "_Partition":
        return cls({}, {}, {}, {}, {})

class ReplayStore:
    """Thread-safe ``partition -> {key -> tags}`` with waiting samples."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._parts: dict[str, _Partition] = {}
        self._arrivals = 0
        # source id -> partition -> keys that source listed last (a dict of
        # None rather than a set: the GC need not traverse it).
        self._listed: dict[str, dict[str, dict[str, None]]] = {}
        # source id -> partition -> keys seen in the snapshot being received.
        self._snapshots: dict[str, dict[str, set[str]]] = {}
        # Tombstones of keys still listed by some source: cleared by unlist.
        self._tomb_listed: dict[str, set[str]] = {}
        # Tombstones of keys no source listed when removed: cleared by the
        # first poll that started after the removal and does not list them.
        self._tomb_pending: dict[tuple[str, str], float] = {}
        self._closed = False
        self._failure: BaseException | None = None

    # -- trainer side -----------------------------------------------------------

    def add(self, partition_id: str, items: Mapping[str, Mapping[str, Any]]) -> None:
        """Merge ``items`` into the partition (``tags.update(new)`` per key)."""
        with self._cond:
            self._check_open()
            part = self._part(partition_id)
            for key, tags in items.items():
                self._merge(part, key, tags)
            self._cond.notify_all()

    def remove(self, partition_id: str, keys: Iterable[str]) -> None:
        """Delete keys; a poll still listing them will not bring them back."""
        now = time.time()
        with self._cond:
            self._check_open()
            part = self._parts.get(partition_id)
            for key in keys:
                if part is not None:
                    self._drop(part, key)
                if self._is_listed(partition_id, key):
                    self._tomb_listed.setdefault(partition_id, set()).add(key)
                else:
                    self._tomb_pending[(partition_id, key)] = now
            self._cond.notify_all()

    def snapshot(self, partition_id: str | None = None) -> dict[str, dict[str, Tags]] | dict[str, Tags]:
        """A deep copy of all partitions, or of one (empty if unknown)."""
        with self._cond:
            self._check_open()
            if partition_id is not None:
                part = self._parts.get(partition_id)
                return {k: _thaw(v) for k, v in part.items.items()} if part else {}
            return {pid: {k: _thaw(v) for k, v in part.items.items()}
                    for pid, part in self._parts.items() if part.items}

    def key_count(self) -> int:
        with self._cond:
            return sum(len(part.items) for part in self._parts.values())

    def sample(self, partition_id: str, *, global_steps: Any = None, batch_size: int | None = None,
               timeout: float | None = None) -> BatchMeta:
        """Wait for a batch; see :meth:`buffer.ReplayBuffer.sample`."""
        if (global_steps is None) == (batch_size is None):
            raise ValueError("pass exactly one of global_steps= or batch_size=")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open()
                if self._failure is not None:
                    raise self._failure
                if global_steps is not None:
                    batch = self._try_step(partition_id, global_steps)
                else:
                    assert batch_size is not None
                    batch = self._try_size(partition_id, batch_size)
                if batch is not None:
                    return batch
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(self._waiting_for(partition_id, global_steps, batch_size, timeout))
                self._cond.wait(remaining)

    # -- source side (called by the stream receiver) ----------------------------

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
            part = self._part(partition_id)
            resync = snapshot is not None
            if tomb is None and not self._tomb_pending:  # the common case: no removal in flight
                for key, tags in items.items():
                    self._merge(part, key, tags, resync)
                self._cond.notify_all()
                return
            for key, tags in items.items():
                if tomb is not None and key in tomb:
                    continue
                if self._tomb_pending and (partition_id, key) in self._tomb_pending:
                    # A poll that began before the removal still listed it.
                    del self._tomb_pending[(partition_id, key)]
                    self._tomb_listed.setdefault(partition_id, set()).add(key)
                    tomb = self._tomb_listed[partition_id]
                    continue
                self._merge(part, key, tags, resync)
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

    def poll_completed(self, source_id: str, started_at: float) -> None:
        """A poll that began at ``started_at`` (wall clock) has been applied."""
        with self._cond:
            if not self._tomb_pending:
                return
            expired = [pk for pk, removed_at in self._tomb_pending.items()
                       if removed_at < started_at and not self._is_listed(*pk)]
            for pk in expired:
                del self._tomb_pending[pk]

    # -- lifecycle ----------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """Make every current and future ``sample()`` raise ``error``."""
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

    # -- internals (lock held) ----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosed("the replay buffer is closed")

    def _part(self, partition_id: str) -> _Partition:
        part = self._parts.get(partition_id)
        if part is None:
            part = self._parts[partition_id] = _Partition.empty()
        return part

    def _is_listed(self, partition_id: str, key: str) -> bool:
        return any(key in parts.get(partition_id, ()) for parts in self._listed.values())

    def _unlist(self, source_id: str, partition_id: str, keys: Iterable[str]) -> None:
        listed = self._listed.get(source_id, {}).get(partition_id)
        part = self._parts.get(partition_id)
        tomb = self._tomb_listed.get(partition_id)
        for key in list(keys):
            if listed is not None:
                listed.pop(key, None)
            if self._is_listed(partition_id, key):
                continue
            if tomb is not None and key in tomb:
                tomb.discard(key)  # the source stopped listing it: new again
            elif part is not None:
                self._drop(part, key)

    def _merge(self, part: _Partition, key: str, new: Mapping[str, Any], resync: bool = False) -> None:
        held = part.items.get(key)
        if held is None:
            current = dict(new)
            self._arrivals += 1
            part.arrival[key] = self._arrivals
            old_class: tuple[Any, Any] = (None, None)
        else:
            # During a snapshot most tags come back unchanged: equal bytes
            # (0.3 us) skip the thaw and re-freeze (1 us). A delta changed them.
            if resync and type(new) is dict and _freeze(new) == held:
                return
            current = marshal.loads(held) if type(held) is bytes else held
            old_class = _classify(current)
            current.update(new)
        part.items[key] = _freeze(current)
        self._reindex(part, key, old_class, _classify(current))

    def _drop(self, part: _Partition, key: str) -> None:
        held = part.items.pop(key, None)
        if held is None:
            return
        self._reindex(part, key, _classify(_thaw(held)), (None, None))
        del part.arrival[key]

    def _reindex(self, part: _Partition, key: str, old: tuple[Any, Any], new: tuple[Any, Any]) -> None:
        if old == new:
            return
        old_step, old_status = old
        if old_status == RUNNING and old_step is not None:
            running = part.running_by_step.get(old_step)
            if running is not None:
                running.discard(key)
                if not running:
                    del part.running_by_step[old_step]
        elif old_status == SUCCESS:
            part.success.pop(key, None)
            if old_step is not None:
                succeeded = part.success_by_step.get(old_step)
                if succeeded is not None:
                    succeeded.pop(key, None)
                    if not succeeded:
                        del part.success_by_step[old_step]
        new_step, new_status = new
        if new_status == RUNNING and new_step is not None:
            part.running_by_step.setdefault(new_step, set()).add(key)
        elif new_status == SUCCESS:
            order = part.arrival[key]
            part.success[key] = order
            if new_step is not None:
                part.success_by_step.setdefault(new_step, {})[key] = order

    def _batch(self, partition_id: str, part: _Partition, keys: list[str]) -> BatchMeta:
        return BatchMeta(partition_id, keys, [_thaw(part.items[k]) for k in keys])

    def _try_step(self, partition_id: str, step: Any) -> BatchMeta | None:
        part = self._parts.get(partition_id)
        if part is None:
            return BatchMeta(partition_id, [], [])
        if part.running_by_step.get(step):
            return None
        succeeded = part.success_by_step.get(step, {})
        keys = sorted(succeeded, key=succeeded.__getitem__)
        return self._batch(partition_id, part, keys)

    def _try_size(self, partition_id: str, n: int) -> BatchMeta | None:
        part = self._parts.get(partition_id)
        if part is None or len(part.success) < n:
            return None
        keys = heapq.nsmallest(n, part.success, key=part.success.__getitem__)
        return self._batch(partition_id, part, keys)

    def _waiting_for(self, partition_id: str, step: Any, n: int | None, timeout: float | None) -> str:
        call = f"sample({partition_id!r}, " + (f"global_steps={step!r}" if n is None else f"batch_size={n}") + ")"
        part = self._parts.get(partition_id) or _Partition.empty()
        if n is None:
            running = sorted(part.running_by_step.get(step, ()), key=part.arrival.__getitem__)
            names = ", ".join(running[:5]) + (", ..." if len(running) > 5 else "")
            return (f"{call} timed out after {timeout:g}s: {len(running)} key(s) of step {step!r} "
                    f"still 'running' ({names})")
        return f"{call} timed out after {timeout:g}s: only {len(part.success)} of {n} 'success' key(s) present"
