"""The ledger: what each stream lists, what the trainer removed, and whether a view is whole.

A *stream* is what one poller sends, named by the poller's stream name (the
ZeroMQ identity it connects with; ``stats()["poller_name"]`` for the
buffer's own), the same name across code, stats and docs.

Pure bookkeeping: no tags, no locks, no policies, no sockets. The
:class:`~buffer.partitions.PartitionStore` owns one, calls it under its lock
for every event of the stream and of the trainer, and applies the decisions
it returns (which listed keys to merge, which keys to drop). Tested on its
own against a plain model (``tests/test_ledger.py``).

Why it exists: the store must tell

* a key that vanished from the store (drop it), from
* a key the trainer removed while a poll already under way still lists it
  (a *tombstone*: ignore that key until the source stops listing it).

A removal of a key no source lists leaves a *pending* tombstone: a poll that
began before the removal may still list the key. Whether a poll began before
the removal is told by the source's poll numbers, never by clocks (the
trainer's and a poller's host may disagree by any amount). At the removal
the ledger notes, per stream, the highest poll it has received any message
of, ``m``; poll ``m + 1`` may already be listing, and a poll numbered
``m + 2`` or later began after poll ``m + 1`` was sent whole, so after the
removal unless the receiver was a whole poll behind its poller. The first
*complete* poll past that horizon that does not list the key ends the
pending tombstone.

A view is *whole* when every key reflects complete listings: the sources
the view requires (the buffer's own poller) have had a first complete poll
applied, and no source listing the partition is half-way through a full
listing or awaiting a resync after a loss.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import not_
from typing import Iterable, Mapping

__all__ = ["Ledger"]

# stream -> (epoch, a poll number)
Horizon = Mapping[str, tuple[int, int]]


class Ledger:
    """Listings, snapshots, tombstones, poll horizons and sync answers of every stream."""

    def __init__(self) -> None:
        # stream -> partition -> keys that stream lists (a dict of True rather than a
        # set: the GC need not traverse it, and a copy is one C-level block copy).
        self._listed: dict[str, dict[str, dict[str, bool]]] = {}
        # stream -> partitions the full listing being received has listed so far.
        self._snapshots: dict[str, set[str]] = {}
        # stream -> partition -> keys listed before that full listing and not listed by it
        # yet: a copy taken as it begins, each key crossed off as it comes again, so what
        # is left at its end has vanished. A resync of K keys costs one C-level pop per key
        # (1M: ~0.2 s), where an update of the listed keys, a set of the listing's and a
        # difference cost ~1 s.
        self._unseen: dict[str, dict[str, dict[str, bool]]] = {}
        # Tombstones of keys some source listed when removed: ended by an unlisting.
        self._tomb_listed: dict[str, set[str]] = {}
        # Tombstones of keys no source listed when removed -> the removal's horizon.
        self._tomb_pending: dict[tuple[str, str], Horizon] = {}
        # stream -> (epoch, highest poll number received any message of).
        self._seen: dict[str, tuple[int, int]] = {}
        # stream -> highest sync token a complete poll answered; epoch of its last complete poll.
        self._synced: dict[str, int] = {}
        self._completed_epoch: dict[str, int] = {}
        # Sources every view needs a first complete poll of, and sources awaiting a resync.
        self._required: set[str] = set()
        self._broken: set[str] = set()

    # -- the stream -------------------------------------------------------------------

    def poll_seen(self, stream: str, epoch: int, poll: int) -> None:
        """A message of poll ``poll`` of ``stream``'s process ``epoch`` arrived."""
        seen = self._seen.get(stream)
        if seen is None or seen[0] != epoch or seen[1] < poll:
            self._seen[stream] = (epoch, poll)

    def listed(self, stream: str, partition: str, keys: Iterable[str]) -> list[str] | None:
        """``stream`` lists ``keys``; the ones whose tags to merge (``None``: all of them)."""
        keys = list(keys)
        listed = self._listed.setdefault(stream, {}).setdefault(partition, {})
        snapshot = self._snapshots.get(stream)
        if snapshot is None:
            listed.update(dict.fromkeys(keys, True))
        else:
            snapshot.add(partition)
            unseen = self._unseen[stream].get(partition)
            # Keys listed before are crossed off (True); the others are new to this stream.
            new = list(compress(keys, map(not_, map(unseen.pop, keys, repeat(False))))) if unseen else keys
            if new:
                listed.update(dict.fromkeys(new, True))
        tomb = self._tomb_listed.get(partition)
        if tomb is None and not self._tomb_pending:  # the common case: no removal in flight
            return None
        merge = []
        for key in keys:
            if tomb is not None and key in tomb:
                continue
            if self._tomb_pending and (partition, key) in self._tomb_pending:
                # Listed while the removal is pending: it stays removed while listed.
                del self._tomb_pending[(partition, key)]
                tomb = self._tomb_listed.setdefault(partition, set())
                tomb.add(key)
                continue
            merge.append(key)
        return merge

    def unlisted(self, stream: str, partition: str, keys: Iterable[str]) -> list[str]:
        """``stream`` no longer lists ``keys``; the ones to drop (no other source lists them, none removed)."""
        listed = self._listed.get(stream, {}).get(partition)
        unseen = self._unseen.get(stream, {}).get(partition)
        tomb = self._tomb_listed.get(partition)
        drop = []
        for key in list(keys):
            if listed is not None:
                listed.pop(key, None)
            if unseen is not None:
                unseen.pop(key, None)
            if self.is_listed(partition, key):
                continue
            if tomb is not None and key in tomb:
                tomb.discard(key)  # the source stopped listing it: new again
            else:
                drop.append(key)
        return drop

    def begin_snapshot(self, stream: str) -> None:
        """A full listing from ``stream`` starts; what it omits has vanished."""
        self.abandon_snapshot(stream)  # one begun before and never ended: what it listed stays listed
        self._snapshots[stream] = set()
        self._unseen[stream] = {partition: keys.copy() for partition, keys in self._listed.get(stream, {}).items()
                                if keys}

    def in_snapshot(self, stream: str) -> bool:
        return stream in self._snapshots

    def end_snapshot(self, stream: str) -> list[tuple[str, list[str]]]:
        """The full listing is complete: ``(partition, keys)`` to drop, those it did not list."""
        if self._snapshots.pop(stream, None) is None:
            return []
        self._broken.discard(stream)
        drops = []
        for partition, vanished in self._unseen.pop(stream).items():
            if vanished:
                drops.append((partition, self.unlisted(stream, partition, list(vanished))))
        return drops

    def abandon_snapshot(self, stream: str) -> None:
        """A full listing was cut short (a gap, a new epoch): what it listed stays listed, and nothing vanished."""
        self._snapshots.pop(stream, None)
        self._unseen.pop(stream, None)

    def poll_completed(self, stream: str, epoch: int, poll: int, sync: int | None = None) -> bool:
        """Poll ``poll`` of ``stream``/``epoch`` was applied whole; True when sync waiters should look again.

        ``sync`` is the highest sync token the poller had received when the
        poll's listing began.
        """
        wake = False
        if (sync is not None and sync > self._synced.get(stream, 0)) or self._completed_epoch.get(stream) != epoch:
            # Answered, or a new poller process to ask again.
            self._synced[stream] = max(sync or 0, self._synced.get(stream, 0))
            self._completed_epoch[stream] = epoch
            wake = True
        if self._tomb_pending:
            expired = [pk for pk, horizon in self._tomb_pending.items()
                       if _after(horizon, stream, epoch, poll) and not self.is_listed(*pk)]
            for pk in expired:
                del self._tomb_pending[pk]
        return wake

    def synced(self, stream: str) -> int:
        """The highest sync token a complete poll of ``stream`` answered (0: none)."""
        return self._synced.get(stream, 0)

    # -- the trainer ------------------------------------------------------------------

    def removed(self, partition: str, keys: Iterable[str]) -> None:
        """The trainer removed ``keys``: none comes back while a source still lists it."""
        horizon: dict[str, tuple[int, int]] | None = None
        for key in keys:
            if self.is_listed(partition, key):
                self._tomb_listed.setdefault(partition, set()).add(key)
            else:
                if horizon is None:  # one per call, shared by its keys
                    horizon = {stream: (epoch, poll + 1) for stream, (epoch, poll) in self._seen.items()}
                self._tomb_pending[(partition, key)] = horizon

    def is_listed(self, partition: str, key: str) -> bool:
        """Whether some stream lists ``key`` (in the full listing under way, or in the one before)."""
        return any(key in parts.get(partition, ()) for parts in self._listed.values())

    # -- whole views ------------------------------------------------------------------

    def require(self, stream: str) -> None:
        """No view is whole until a first complete poll of ``stream`` was applied (the buffer's own poller)."""
        self._required.add(stream)

    def mark_broken(self, stream: str) -> None:
        """``stream``'s stream lost messages; what it lists is not whole until its next full listing ends."""
        self._broken.add(stream)

    def release(self, stream: str) -> None:
        """Stop waiting for ``stream`` (a standalone poller gone silent or forgotten)."""
        self.abandon_snapshot(stream)
        self._broken.discard(stream)

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
                return f"the stream of poller {stream} lost messages and a resync is awaited"
        for stream in list(self._snapshots) + list(self._broken):
            if stream in self._required:
                continue
            if partition is None or partition in self._snapshots.get(stream, ()) \
                    or partition in self._listed.get(stream, ()):
                what = "being applied" if stream in self._snapshots else "awaited after a loss"
                return f"a full listing of poller {stream}, which lists this partition, is {what}"
        return None


def _after(horizon: Horizon, stream: str, epoch: int, poll: int) -> bool:
    """Whether poll ``poll`` of ``stream``/``epoch`` began after the removal with ``horizon``.

    A process unseen at the removal (new stream, restarted poller) may have
    had its first poll under way then.
    """
    known = horizon.get(stream)
    if known is None or known[0] != epoch:
        return poll > 1
    return poll > known[1]
