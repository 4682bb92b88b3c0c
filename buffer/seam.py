"""The one seam between a buffer and its sampling policies: what a policy uses of a buffer, and what it implements.

A sampling policy (``ReplayBuffer.sample``'s :mod:`buffer.steps`, :mod:`buffer.verl`) keeps its own index
from the store's changes (:class:`Policy`, :class:`BulkPolicy`) and decides on it through
:class:`SamplingSeam` alone. The seam knows no transport: it asks the pollers through :class:`Listings`
(:class:`buffer.sync.ListingSync`), so sampling means the same on every source. The helper threads of its
waits close the module.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Hashable, Iterable, Protocol, TypeVar

from buffer.store import PartitionStore
from poller.wire.vocabulary import Tags

__all__ = ["BulkPolicy", "Listings", "Policy", "SamplingSeam", "WatchWhileWaiting"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Policy(Protocol):
    """Sampling semantics over a :class:`~buffer.store.PartitionStore`: indexes kept from changes."""

    def on_change(self, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        """Called with the store lock held after one key changed (old None: added; new None: dropped).
        Must be cheap, must not call back into the store, must not mutate the dicts."""


class BulkPolicy(Policy, Protocol):
    """A policy that can also take many new keys in one call, and names the tags it reads (each optional): a
    snapshot's thousands of keys then cost a few C-level passes instead of a Python call each, and a poll's
    changed keys are told of only where a tag it reads changed."""

    def on_added(self, partition_id: str, keys: list[str], tags: list[Tags]) -> None:
        """:meth:`Policy.on_change` with ``old=None`` for each of ``keys`` in order."""

    #: The tag names the index reads (optional): a held key whose tags keep these values is not told of.
    #: The store compares them, for all of a poll's changed keys at once.
    indexed_tags: tuple[str, ...]


class Listings(Protocol):
    """What the seam asks of the pollers streaming to the store (the transport side implements it)."""

    @property
    def has_own_poller(self) -> bool:
        """Whether the buffer has a poller of its own to ask (standalone pollers keep their own schedule)."""

    def wait(self, timeout: float | None, standalone: bool = True) -> None:
        """Return once a listing that began after the call is applied, from the own poller (and standalone ones)."""

    def watch(self, partition: str, keys: list[str], seconds: float, every: float) -> None:
        """Have the own poller watch ``keys`` of ``partition`` for ``seconds`` (no keys: stop); a change it sees
        brings a listing forward, no sooner than ``every`` after the last one it brought forward."""

    def silence(self) -> str | None:
        """How long the store has not answered the listing the own poller has under way, if it is long."""

    def view_age(self) -> float:
        """Seconds since the store was last known to be listed whole into the view (``inf``: never)."""

    def watch_reads(self) -> int:
        """The own poller's reads of watched keys so far, as its last heartbeat said."""

    def quarantined(self, partition_id: str) -> list[tuple[str, str]]:
        """``(key, reason)`` of the keys of ``partition_id`` the pollers leave out (the first few named)."""


class SamplingSeam:
    """What a sampling policy uses of a buffer: its store under lock, read-your-writes, deadline waits, clearing."""

    def __init__(self, store: PartitionStore, listings: Listings | None = None) -> None:
        self._store = store
        self._listings = listings

    def attach(self, policy: Policy) -> None:
        """Attach ``policy``; it first sees every key held as an addition."""
        self._store.attach(policy)

    def decide(self, attempt: Callable[[], T | None], *, partition_id: str, timeout: float | None,
               describe: Callable[[], str], log_every: float | None = None, what: str = "a decision",
               poll_every: float | None = None, on_poll: Callable[[], None] | None = None,
               version: Callable[[], Hashable] | None = None,
               watch: Callable[[], list[str]] | None = None) -> T:
        """``attempt()``'s first non-None result, on a whole view of ``partition_id``, waking on every change.

        ``attempt`` runs under the store's lock and must not block. ``version`` (read under the lock,
        changing whenever anything ``attempt`` reads does) skips wake-ups that find the last run's version.
        ``log_every``: log ``describe()`` at INFO that often. ``poll_every``: while waiting, ask the own poller
        for a listing every that many seconds from the wait's start (``on_poll`` after each). ``watch`` (run
        under the lock after an attempt that found nothing): at most
        :data:`~poller.wire.protocol.MAX_WATCH_KEYS` keys the decision waits on, which the poller reads
        cheaply and lists as soon as one changed, no more often than ``poll_every`` (:mod:`poller.polling`),
        on a source that can (only with ``poll_every``).

        Raises:
            TimeoutError: at the deadline, with ``describe()`` (and the partition's quarantined keys).
            PollerCrashed: the poller is dead for good.
            BufferClosed: the buffer was closed, possibly while waiting.
        """
        def described() -> str:
            return describe() + self._quarantine_note(partition_id)

        own = self._listings if self._listings is not None and self._listings.has_own_poller else None
        watcher = None
        if watch is not None and poll_every is not None and own is not None and timeout != 0:
            watcher = WatchWhileWaiting(own.watch, partition_id, poll_every)
            attempt = _watching(attempt, watch, watcher)
        attempt = _when_changed(attempt, version)
        hurry: threading.Event | None = None  # set: stop asking
        try:
            try:
                # The first look builds no message unless it is the only one.
                return self._store.wait_until(attempt, timeout=0, describe=described if timeout == 0 else str,
                                              view=partition_id)
            except TimeoutError:
                if timeout == 0:
                    raise
            deadline = None if timeout is None else time.monotonic() + timeout
            if poll_every is not None and own is not None:
                hurry = _poll_while_waiting(own.wait, poll_every, on_poll or (lambda: None), own.view_age)
            started = last_log = time.monotonic()
            while True:
                now = time.monotonic()
                wait = None if deadline is None else deadline - now
                if log_every is not None:
                    until_log = log_every - (now - last_log)
                    wait = until_log if wait is None else min(wait, until_log)
                try:
                    return self._store.wait_until(attempt, timeout=None if wait is None else max(0.0, wait),
                                                  view=partition_id, describe=described)
                except TimeoutError as exc:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise
                    last_log = time.monotonic()
                    logger.info("%s waiting for %.0fs: %s", what, last_log - started, exc)
        finally:
            if hurry is not None:
                hurry.set()  # a sync() in flight ends with its listing (milliseconds) or its bound
            if watcher is not None:
                watcher.stop()

    def look(self, read: Callable[[], T]) -> T:
        """``read()`` under the store's lock, at once (no wait, whole view or not)."""
        return self._store.read(read)

    def tags(self, partition_id: str, keys: Iterable[str]) -> dict[str, Tags]:
        """Copies of the held tags of ``keys`` (keys not held are left out)."""
        return self._store.get(partition_id, keys)

    def sync(self, timeout: float | None) -> None:
        """Return once a listing that began after the call is applied, from every poller streaming to the buffer."""
        self._store.check_open()
        if self._listings is not None:
            self._listings.wait(timeout)

    def not_fresh(self) -> str | None:
        """Why no decision could be made on the view now (its store not answering, how long; too old), or that the
        store has not answered a listing under way for long; None."""
        stale = self._store.view_stale()
        if stale is None and self._listings is not None:
            stale = self._listings.silence()
        return stale

    def view_age(self) -> float:
        """Seconds since the store was last known to be listed whole into the view (0: nobody to ask)."""
        return self._listings.view_age() if self._listings is not None else 0.0

    def watch_reads(self) -> int:
        """The own poller's reads of watched keys so far, summed over its processes (0: no poller of its own)."""
        return self._listings.watch_reads() if self._listings is not None else 0

    def forget_cleared(self, partition_id: str, keys: Iterable[str]) -> None:
        """Drop keys the policy cleared in the store (the clear returned) from the buffer's view: a poll that began
        before still listing them does not bring them back; one that began after shows them if the store holds
        them again, as the store's own listing would."""
        self._store.remove(partition_id, keys, cleared=True)

    def quarantined(self, partition_id: str) -> list[tuple[str, str]]:
        """``(key, reason)`` of the keys of ``partition_id`` the pollers leave out (the first few named)."""
        return self._listings.quarantined(partition_id) if self._listings is not None else []

    def _quarantine_note(self, partition_id: str) -> str:
        named = self.quarantined(partition_id)
        if not named:
            return ""
        shown = "; ".join(f"{key!r}: {why}" for key, why in named[:5])
        more = f" and {len(named) - 5} more" if len(named) > 5 else ""
        return (f"; {len(named)} key(s) of this partition are quarantined (never streamed, their tags cannot go "
                f"on the wire): {shown}{more}")


def _watching(attempt: Callable[[], T | None], watch: Callable[[], list[str]],
              watcher: WatchWhileWaiting) -> Callable[[], T | None]:
    """``attempt`` that, when it finds nothing, hands the keys it waits on to ``watcher`` (under the same lock)."""
    def watched() -> T | None:
        result = attempt()
        if result is None:
            watcher.update(watch())
        return result

    return watched


def _when_changed(attempt: Callable[[], T | None], version: Callable[[], Hashable] | None) -> Callable[[], T | None]:
    """``attempt`` that returns None at once while ``version()`` is the one its last run saw: most
    wake-ups find nothing new (verl's rule ran ~34 times per ``sample()``, 6 with this). Both reads run
    under the store's lock, which a change takes before it notifies, so no wake-up is lost."""
    if version is None:
        return attempt
    seen: list[Hashable] = []  # the version of the last run; empty: never ran

    def gated() -> T | None:
        if seen and seen[0] == version():
            return None
        result = attempt()
        seen[:] = [version()]  # read after the run: an attempt may update what it depends on
        return result

    return gated


# Each sync() of _poll_while_waiting is bounded, so a stalled source cannot keep its thread long past the stop.
_POLL_BOUND = 2.0
# A slot of _poll_while_waiting is spared when a listing began within this share of its gap before it.
_SLOT_SPARED = 0.1


def _poll_while_waiting(sync: Callable[[float | None, bool], None], gap: float, on_poll: Callable[[], None],
                        view_age: Callable[[], float]) -> threading.Event:
    """Ask for a listing every ``gap`` seconds from now (``sync``, then ``on_poll``), in a thread, until the event is
    set: the listings verl's sampler makes while it waits, at the same times, so a waiting decision never sees a
    change later than with it. A slot is skipped when a listing began within :data:`_SLOT_SPARED` of it (one a
    watched change brought forward: listing again would show almost nothing more)."""
    stopped = threading.Event()
    anchor = time.monotonic()

    def run() -> None:
        slot = 1
        while not stopped.is_set():
            due = anchor + slot * gap - time.monotonic()
            if due > 0:
                stopped.wait(due)
                continue
            if view_age() >= gap * _SLOT_SPARED:
                try:
                    sync(_POLL_BOUND, False)  # the buffer's own poller alone: standalone ones keep their schedule
                except TimeoutError:
                    pass  # a stall or a restart: the waiter's own deadline and log cover it
                except BaseException:  # closed or crashed: the waiting decision raises it itself
                    return
                else:
                    on_poll()
            # The next slot still ahead (a slow listing may have spanned several).
            slot = max(slot + 1, math.floor((time.monotonic() - anchor) / gap) + 1)

    threading.Thread(target=run, name="replay-wait-poll", daemon=True).start()
    return stopped


class WatchWhileWaiting:
    """Keeps the own poller watching the keys a waiting decision waits on, until :meth:`stop`.

    :meth:`update` (under the store's lock: it never blocks) gives the keys; a thread sends them in a WATCH
    when they changed and every :data:`RENEW` seconds, as the poller forgets a watch after :data:`LASTS`
    seconds (a dead trainer leaves nothing read on its behalf; a restarted poller has the keys within a second).
    """

    #: Seconds between two WATCHes of the same keys.
    RENEW = 1.0
    #: How long the poller keeps watching after a WATCH (a few renewals may be lost).
    LASTS = 3.0

    def __init__(self, send: Callable[[str, list[str], float, float], None], partition: str, every: float) -> None:
        self._send = send
        self._partition = partition
        self._every = every  # the least time between two listings a change it sees brings forward
        self._keys: list[str] | None = None
        self._changed = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, keys: list[str]) -> None:
        """The keys the decision waits on now (at most ``MAX_WATCH_KEYS``); no keys: nothing to watch."""
        if keys == self._keys:
            return
        self._keys = keys
        self._changed.set()
        if self._thread is None and keys:
            self._thread = threading.Thread(target=self._run, name="replay-watch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        sent: list[str] | None = None
        while not self._stopped.is_set():
            keys = self._keys
            self._changed.clear()
            if keys or (keys is not None and sent):  # new keys or a renewal; or none now, after some: stop
                self._send(self._partition, keys or [], self.LASTS if keys else 0.0, self._every)
                sent = keys
            self._changed.wait(self.RENEW)  # a stop wakes it too, ending the loop before another WATCH
        if sent:
            self._send(self._partition, [], 0.0, self._every)

    def stop(self) -> None:
        """End the watch (the poller is told); waits for the thread briefly (it never blocks on the store)."""
        self._stopped.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(1.0)
