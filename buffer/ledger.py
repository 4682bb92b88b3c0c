"""The ledger: which stream lists which key, what the trainer removed, and whether a view is whole and fresh.

Pure bookkeeping, no tags, locks, policies or sockets: :class:`~buffer.store.PartitionStore` calls it under
its lock and applies what it decides, and the simulation (tests/simulation) drives it step by step.

A *stream* is what one poller sends, named by its ZeroMQ identity. Three questions are answered here:

- **What a stream lists.** Each key a stream listed, at the version it listed (its packed tags). A full listing
  (a snapshot) that omits a key listed before says it vanished. A key no stream lists is dropped.
- **What the trainer removed.** A removal leaves a *tombstone* that hides the record *as removed* (the version the
  store held and every version a stream listed then), never the name: those versions stay hidden; another version
  is a new record, shown at once when listed by a poll that began after the removal, else *in doubt* until that
  stream's first complete poll that did (then shown if still listed). A tombstone lasts while a stream may still
  send a listing begun before the removal (it is *waiting* on that stream) or while a stream lists a removed
  version; then it ends, and a later listing of the name is new. A removal of keys the trainer *cleared* in the
  store first (buffer.verl) hides them only from listings that may predate it: the store no longer held them, so a
  listing begun after it that shows one, whatever its version, shows it put again.
- **Whether a view is whole and fresh.** Whole: the streams it requires (the buffer's own poller) had a first
  complete poll applied and no stream listing the partition is half-way through a full listing or awaiting a
  resync. Fresh: each required stream answers and its last complete poll is at most ``max_age`` s old, and no
  key of the view is vouched for only by streams that fell silent (no message past ``stale_after``, or BYE). A
  stream silent longer than ``max_age`` is *withdrawn*: what only it listed is dropped, and when it speaks again
  it lists anew.

"Began after" is told by sync tokens, never by clocks nor by poll numbers (any number of polls may be on their way
unreceived): a removal issues a token, which the buffer hands every poller as a *mark* (a SYNC asking for no poll,
buffer.stream); a poll answering it, or a later token, read it before it listed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import compress, repeat
from operator import ne
from typing import Any

__all__ = ["Ledger", "Version"]

# One record of a key as a stream listed it: packed tags (``bytes``) or a dict; compared with ``==``, never read.
Version = Any
# (partition, key)
_Name = tuple[str, str]
_UNLISTED = object()
# How many keys a view's staleness message names.
_NAMED = 3


class _Tomb:
    """A removal: its token, the versions removed, and the streams it still waits on or doubts."""

    __slots__ = ("token", "versions", "waiting", "doubt", "cleared")

    def __init__(self, token: int, versions: list[Version], waiting: set[str], cleared: bool = False) -> None:
        self.token = token  # issued at the removal: a poll answering it (or a later one) began after
        self.versions = versions
        self.cleared = cleared  # the store no longer held the keys at the removal: a later listing shows them
        self.waiting = waiting  # streams that may still send a listing begun before the removal
        self.doubt: set[str] = set()  # streams listing a new version that may predate the removal

    def began_after(self, sync: int) -> bool:
        """Whether a poll answering sync token ``sync`` began after the removal."""
        return sync >= self.token

    def hides(self, stream: str, version: Version) -> bool:
        """Whether ``version``, as ``stream`` lists it now, is the record removed (or may be)."""
        if self.cleared and stream not in self.waiting:
            return stream in self.doubt  # listed since the clear: put again
        return version in self.versions or stream in self.doubt


class Ledger:
    """Listings, snapshots, tombstones, poll horizons, sync tokens and answers, and silence, of every stream
    (the module docstring says what each decides). ``tests/test_ledger.py`` checks it against a model."""

    def __init__(self) -> None:
        # stream -> partition -> key that stream lists -> the version it listed last (atomic values:
        # the GC need not traverse it). A partition of which a stream lists no key has no entry.
        self._listed: dict[str, dict[str, dict[str, Version]]] = {}
        # stream -> partitions the full listing being received has listed so far.
        self._snapshots: dict[str, set[str]] = {}
        # stream -> partition -> keys listed before that full listing and not by it yet, crossed off
        # as they come again (1M: ~0.2 s, a set difference ~1 s); what is left at its end has vanished.
        self._unseen: dict[str, dict[str, dict[str, Version]]] = {}
        # partition -> key -> its tombstone; stream -> the tombstones waiting on it.
        self._tombs: dict[str, dict[str, _Tomb]] = {}
        self._waiting_on: dict[str, set[_Name]] = {}
        # stream -> (epoch, highest poll received any message of; 0: announced only); the sync token the poll of
        # the message being applied answers.
        self._seen: dict[str, tuple[int, int]] = {}
        self._current: dict[str, int] = {}
        # The last sync token issued (issue_token); stream -> the highest a complete poll answered; the epoch of
        # its last complete poll.
        self._issued = 0
        self._synced: dict[str, int] = {}
        self._completed_epoch: dict[str, int] = {}
        # Streams every view needs a first complete poll of; stream -> why its next full listing is awaited.
        self._required: set[str] = set()
        self._broken: dict[str, str] = {}
        # Fresh views: when each stream's last complete poll was applied; since when (and why) a stream has not
        # answered, until its next complete poll; the oldest a fresh view may be; the silent streams withdrawn.
        self._completed_at: dict[str, float] = {}
        self._silent: dict[str, tuple[float, str]] = {}
        self._max_age: float | None = None
        self._withdrawn: set[str] = set()

    # -- the stream -------------------------------------------------------------------

    def announce(self, stream: str, epoch: int) -> None:
        """Process ``epoch`` of ``stream`` spoke (before any poll of it arrived): a removal from now on waits on it."""
        seen = self._seen.get(stream)
        if seen is None or seen[0] != epoch:
            self._seen[stream] = (epoch, 0)

    def poll_seen(self, stream: str, epoch: int, poll: int, sync: int = 0) -> None:
        """A message of poll ``poll`` (answering sync token ``sync``) of ``stream``'s process ``epoch`` arrived."""
        self._current[stream] = sync
        seen = self._seen.get(stream)
        if seen is None or seen[0] != epoch or seen[1] < poll:
            self._seen[stream] = (epoch, poll)

    def issue_token(self) -> int:
        """A new sync token, numbered after every removal so far (a poll answering it began after them)."""
        self._issued += 1
        return self._issued

    def listed(self, stream: str, partition: str, keys: Sequence[str],
               versions: Sequence[Version]) -> tuple[list[str] | None, list[str]]:
        """``stream`` lists ``keys`` at ``versions``: the keys whose tags to take (``None``: all of them), and
        those to drop (a removed version listed in place of one shown, that no stream vouches for any more)."""
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
        tombs = self._tombs.get(partition)
        if tombs is None:  # the common case: no removal in flight
            return None, []
        sync = self._current.get(stream, 0)
        merge: list[str] = []
        hidden: list[str] = []
        for key, version in zip(keys, versions):
            tomb = tombs.get(key)
            if tomb is None:
                merge.append(key)
                continue
            after = stream not in tomb.waiting or tomb.began_after(sync)  # this listing began after the removal
            if version in tomb.versions and not (tomb.cleared and after):
                tomb.doubt.discard(stream)  # the record removed, listed again: hidden
                hidden.append(key)
            elif after:
                tomb.doubt.discard(stream)
                merge.append(key)  # a new record of the removed key's name (a cleared one: put again)
                self._end_if_over(partition, key, tomb)
            else:
                tomb.doubt.add(stream)  # may predate the removal: settled when the stream passes it
                hidden.append(key)
        return merge, [key for key in hidden if not self._vouched(partition, key)]

    def unlisted(self, stream: str, partition: str, keys: Iterable[str]) -> list[str]:
        """``stream`` no longer lists ``keys``; the ones to drop (no other stream lists them)."""
        listed = self._listed.get(stream, {}).get(partition)
        unseen = self._unseen.get(stream, {}).get(partition)
        tombs = self._tombs.get(partition)
        drop = []
        for key in list(keys):
            if listed is not None:
                listed.pop(key, None)
            if unseen is not None:
                unseen.pop(key, None)
            tomb = tombs.get(key) if tombs is not None else None
            if tomb is not None:
                tomb.doubt.discard(stream)
                self._end_if_over(partition, key, tomb)
            if not self._vouched(partition, key):
                drop.append(key)
        if listed is not None and not listed:
            del self._listed[stream][partition]
        return drop

    def _end_if_over(self, partition: str, key: str, tomb: _Tomb) -> None:
        """End ``tomb`` once no stream may send a listing begun before it and none lists a removed version (one the
        trainer cleared: none may send a listing begun before it)."""
        if tomb.waiting:
            return
        if not tomb.cleared:
            for parts in self._listed.values():
                items = parts.get(partition)
                if items is not None and items.get(key, _UNLISTED) in tomb.versions:
                    return
        tombs = self._tombs[partition]
        if tombs.get(key) is tomb:
            del tombs[key]
            if not tombs:
                del self._tombs[partition]

    def _passed(self, stream: str, sync: int) -> list[tuple[str, str, Version]]:
        """``stream`` completed a poll: the tombstones it began after stop waiting on it. Returns the new records
        it settles: keys in doubt that it still lists at a version not removed."""
        waiting = self._waiting_on.get(stream)
        if not waiting:
            return []
        shown = []
        for name in list(waiting):
            partition, key = name
            tomb = self._tombs.get(partition, {}).get(key)
            if tomb is None or stream not in tomb.waiting:
                waiting.discard(name)
                continue
            if not tomb.began_after(sync):
                continue
            waiting.discard(name)
            tomb.waiting.discard(stream)
            if stream in tomb.doubt or tomb.cleared:
                tomb.doubt.discard(stream)
                version = self._listed.get(stream, {}).get(partition, {}).get(key, _UNLISTED)
                # A cleared key this poll still lists was put again (a poller sends no unchanged key anew).
                if version is not _UNLISTED and (tomb.cleared or version not in tomb.versions):
                    shown.append((partition, key, version))
            self._end_if_over(partition, key, tomb)
        if not waiting:
            del self._waiting_on[stream]
        return shown

    def begin_snapshot(self, stream: str) -> None:
        """A full listing from ``stream`` starts; what it omits has vanished."""
        self.abandon_snapshot(stream)  # one begun before and never ended: what it listed stays listed
        self._withdrawn.discard(stream)
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

    def poll_completed(self, stream: str, epoch: int, poll: int, *, full: bool, sync: int,
                       now: float) -> tuple[list[tuple[str, list[str]]], list[tuple[str, str, Version]], bool]:
        """Poll ``poll`` of ``stream``/``epoch`` was applied whole at ``now``: ``(drops, shown, wake)``: what a
        full poll did not list, the new records it settles, and whether waiters have news (a sync answered, a
        new process's first poll, a view fresh again)."""
        drops = self._end_snapshot(stream) if full else []
        shown = self._passed(stream, sync)
        last = self._completed_at.get(stream)
        wake = self._silent.pop(stream, None) is not None or (
            self._max_age is not None and last is not None and now - last > self._max_age)
        self._completed_at[stream] = now
        if sync > self._synced.get(stream, 0) or self._completed_epoch.get(stream) != epoch:
            # Answered, or a new poller process to ask again.
            self._synced[stream] = max(sync, self._synced.get(stream, 0))
            self._completed_epoch[stream] = epoch
            wake = True
        return drops, shown, wake

    def synced(self, stream: str) -> int:
        """The highest sync token a complete poll of ``stream`` answered (0: none)."""
        return self._synced.get(stream, 0)

    # -- the trainer ------------------------------------------------------------------

    def removed(self, partition: str, held: Mapping[str, Version | None], cleared: bool = False) -> int | None:
        """The trainer removed ``held``'s keys (with the version the store held, or None); see the module docstring.
        ``cleared``: the trainer cleared them in the store before (the store held none of them at the removal).
        Returns the removal's token, for the pollers as a mark (None: no tombstone needs one).

        A removal that no stream could answer with a listing begun before it (none streams, or a key none lists
        and every stream gone) leaves no tombstone: memory follows the keys held and the live streams.
        """
        live = [stream for stream in self._seen if stream not in self._withdrawn]
        token = None
        tombs = self._tombs.get(partition)
        for key, version in held.items():
            listed = [items[key] for parts in self._listed.values()
                      if (items := parts.get(partition)) is not None and key in items]
            versions = ([version] if version is not None else []) + [v for v in listed if v != version]
            old = tombs.get(key) if tombs is not None else None
            if old is not None:  # removed again: what is removed stays removed while a stream lists it
                versions += [v for v in old.versions if v in listed and v not in versions]
            if not live and not listed:
                if old is not None:
                    del tombs[key]  # type: ignore[union-attr]
                continue
            if token is None:
                token = self.issue_token()
            tomb = _Tomb(token, versions, set(live), cleared)
            if tombs is None:
                tombs = self._tombs[partition] = {}
            tombs[key] = tomb
            for stream in live:
                self._waiting_on.setdefault(stream, set()).add((partition, key))
        if tombs is not None and not tombs:
            self._tombs.pop(partition, None)
        return token

    def _vouched(self, partition: str, key: str) -> bool:
        """Whether some stream lists ``key`` at a version the view may show (not one removed, nor one in doubt)."""
        tomb = self._tombs.get(partition, {}).get(key)
        for stream, parts in self._listed.items():
            version = parts.get(partition, {}).get(key, _UNLISTED)
            if version is not _UNLISTED and (tomb is None or not tomb.hides(stream, version)):
                return True
        return False

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
        self._forget_in_tombs(stream)  # its old store's listings are no more: none of them can come
        self.mark_broken(stream, "has a new store")
        return drops

    def release(self, stream: str) -> None:
        """Stop waiting for a full listing of ``stream`` (a standalone poller gone silent or forgotten)."""
        self.abandon_snapshot(stream)
        self._broken.pop(stream, None)

    def withdraw(self, stream: str) -> list[tuple[str, list[str]]]:
        """``stream`` is gone (silent past ``max_age``, or forgotten): ``(partition, keys)`` to drop, those only it
        listed; no tombstone waits on it. Until its next full listing it vouches for nothing."""
        self.release(stream)
        self._silent.pop(stream, None)
        self._withdrawn.add(stream)
        drops = [(partition, self.unlisted(stream, partition, list(keys)))
                 for partition, keys in list(self._listed.get(stream, {}).items())]
        self._listed.pop(stream, None)
        self._forget_in_tombs(stream)
        return drops

    def _forget_in_tombs(self, stream: str) -> None:
        """No tombstone waits on ``stream`` (gone, or its store replaced)."""
        for partition, key in self._waiting_on.pop(stream, ()):
            tomb = self._tombs.get(partition, {}).get(key)
            if tomb is not None:
                tomb.waiting.discard(stream)
                tomb.doubt.discard(stream)
                self._end_if_over(partition, key, tomb)

    def bound_age(self, max_age: float) -> None:
        """A view is fresh only while each required stream's last complete poll is at most ``max_age`` s old;
        a silent stream is withdrawn past it."""
        self._max_age = max_age

    @property
    def max_age(self) -> float | None:
        return self._max_age

    def not_answering(self, stream: str, since: float, why: str) -> None:
        """``stream`` has not answered since ``since`` (an episode's earliest, with its latest ``why``): its store
        stalled or failed, its poller fell silent or said BYE. Until its next complete poll, a view is not fresh
        if it needs that stream: it is required, or it alone lists a key of the view."""
        first = self._silent.get(stream)
        self._silent[stream] = (since if first is None else min(first[0], since), why)

    def view_stale(self, now: float, partition: str | None = None) -> str | None:
        """Why a whole view of ``partition`` (``None``: of every partition) is not fresh at ``now`` (the trainer's
        ``time.monotonic()``); ``None`` if it is."""
        for stream in self._required:
            stale = self._stale(stream, now)
            if stale is not None:
                return stale
        for stream, (since, why) in list(self._silent.items()):
            if stream in self._required:
                continue
            lonely = self.lonely(stream, partition)
            if lonely:
                where = "the view" if partition is None else f"partition {partition!r}"
                named = ", ".join(f"{p}/{k}" for p, k in lonely[:_NAMED]) + (", ..." if len(lonely) > _NAMED else "")
                bound = "" if self._max_age is None else f", or once silent {self._max_age:g}s (max_view_age)"
                return (f"poller {stream} has not answered for {now - since:.1f}s ({why}) and alone lists "
                        f"{len(lonely)} key(s) of {where} ({named}): decisions wait until it lists again{bound}, "
                        f"when those keys are dropped")
        return None

    def unvouched(self) -> list[str]:
        """The silent streams that alone list keys of the view (:meth:`lonely`)."""
        return [stream for stream in self._silent if stream not in self._required and self.lonely(stream)]

    def lonely(self, stream: str, partition: str | None = None) -> list[_Name]:
        """The keys of ``partition`` (``None``: every partition) that silent ``stream`` lists and no stream that
        answers lists too: a view holding them cannot be fresh. Empty for a stream that answers."""
        if stream not in self._silent or stream in self._withdrawn:
            return []
        parts = self._listed.get(stream, {})
        others = [listed for name, listed in self._listed.items() if name != stream and name not in self._silent]
        lonely = []
        for part in ([partition] if partition is not None else list(parts)):
            items = parts.get(part)
            if not items:
                continue
            tombs = self._tombs.get(part, {})
            other_parts = [listed.get(part, {}) for listed in others]
            for key, version in items.items():
                tomb = tombs.get(key)
                if tomb is not None and tomb.hides(stream, version):
                    continue  # hidden from the view
                if not any(key in other for other in other_parts):
                    lonely.append((part, key))
        return lonely

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
