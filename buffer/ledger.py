"""The ledger: what each stream lists, what the trainer removed, and whether a view is whole.

A *stream* is what one poller sends, named by its ZeroMQ identity. Pure bookkeeping (no tags, locks,
policies or sockets): the :class:`~buffer.partitions.PartitionStore` calls it under its lock and applies
what it decides. ``tests/test_ledger.py`` checks it against a model.

A key the trainer removed while a poll under way still lists it gets a *tombstone*, which hides the
record *as removed* (the versions each stream listed and the store held), never the name: the same
version listed again stays hidden; another version is a new record, shown at once if listed by a poll
begun after the removal, else in doubt until the first complete poll begun after (shown if still listed).
A tombstone ends when no stream lists the key; a removal of a key no stream lists is *pending* until the
first complete poll past it that does not list it.

"Began after" is told by poll numbers, never by clocks: a removal notes per stream the highest poll
received, ``m`` (its *horizon*); poll ``m + 1`` may be listing already, ``m + 2`` began after it.

A view is *whole* when the streams it requires (the buffer's own poller) had a first complete poll applied
and no stream listing the partition is half-way through a full listing or awaiting a resync; *fresh* while
each required stream answers and its last complete poll is at most ``max_age`` s old (the trainer's
``time.monotonic()``). A decision needs both.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import ne
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

__all__ = ["Ledger"]

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
    """Listings, snapshots, tombstones, poll horizons and sync answers of every stream."""

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
        """The trainer removed ``held``'s keys (with the version the store held, or None); see the module docstring."""
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
