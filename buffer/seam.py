"""The one seam between a buffer and its sampling policies.

A sampling policy (the step sampler behind ``ReplayBuffer.sample``, the verl
sampler in :mod:`buffer.verl`) keeps its own index from the store's changes
and decides on it. Everything it may use of the buffer is here, and nothing
else of the buffer is reached into:

* :meth:`SamplingSeam.attach` — the policy's index sees every change, under the store's lock;
* :meth:`SamplingSeam.decide` — an event-driven wait, with a deadline, for a
  decision made on a *whole* view of one partition (never on a listing
  applied half-way), re-run only when what it depends on changed, optionally
  logging progress, asking the poller for listings more often while it waits
  and having it watch the keys the decision waits on;
* :meth:`SamplingSeam.look` — the same lock, no wait (for counts and stats);
* :meth:`SamplingSeam.tags` — copies of held tags;
* :meth:`SamplingSeam.sync` — read your writes (a listing of every poller that began after the call is applied);
* :meth:`SamplingSeam.view_age` — how long ago the store was last known to be listed into the view;
* :meth:`SamplingSeam.remove` — clearing keys from the buffer's view, as ``ReplayBuffer.remove``;
* :meth:`SamplingSeam.quarantined` — the keys of a partition the poller leaves out.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Hashable, Iterable, TypeVar

from buffer.partitions import PartitionStore
from buffer.peers import PeerTable
from buffer.policies import Policy
from buffer.sync import ListingSync, PollWhileWaiting, WatchWhileWaiting
from poller.wire.vocabulary import Tags

__all__ = ["SamplingSeam"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SamplingSeam:
    """What a sampling policy uses of a buffer: its store under lock, read-your-writes, deadline waits, clearing."""

    def __init__(self, store: PartitionStore, listing_sync: ListingSync | None = None,
                 table: PeerTable | None = None) -> None:
        self._store = store
        self._listing_sync = listing_sync
        self._table = table

    def attach(self, policy: Policy) -> None:
        """Attach ``policy``; it first sees every key held as an addition."""
        self._store.attach(policy)

    def decide(self, attempt: Callable[[], T | None], *, partition_id: str, timeout: float | None,
               describe: Callable[[], str], log_every: float | None = None, what: str = "a decision",
               poll_every: float | None = None, on_poll: Callable[[], None] | None = None,
               version: Callable[[], Hashable] | None = None,
               watch: Callable[[], list[str]] | None = None) -> T:
        """``attempt()``'s first non-None result, on a whole view of ``partition_id``, waking on every change.

        ``attempt`` runs under the store's lock and must not block. With
        ``version`` (read under the lock too: a value that changes whenever
        anything ``attempt`` reads does), a wake-up that finds the version
        ``attempt`` last ran on does not run it again. With
        ``log_every``, the wait logs ``describe()`` at INFO that often; with
        ``poll_every``, the poller is asked for a listing that often while the
        wait lasts (``on_poll`` after each one applied), so the change that
        completes it shows a fraction of a poll interval after it happened.
        With ``watch`` (run under the lock after each attempt that found
        nothing: the keys of ``partition_id`` the decision waits on, at most
        :data:`~poller.wire.messages.MAX_WATCH_KEYS`), the poller reads those keys
        cheaply while the wait lasts and lists as soon as one changed, on a
        source that can (:mod:`poller.polling`; elsewhere it changes nothing).

        Raises:
            TimeoutError: at the deadline, with ``describe()`` (and the
                partition's quarantined keys, which never arrive).
            PollerCrashed: the poller is dead for good.
            BufferClosed: the buffer was closed, possibly while waiting.
        """
        def described() -> str:
            return describe() + self._quarantine_note(partition_id)

        watcher = None
        if watch is not None and timeout != 0 and self._listing_sync is not None \
                and self._listing_sync.has_own_poller:
            watcher = WatchWhileWaiting(self._listing_sync.watch, partition_id)
            attempt = _watching(attempt, watch, watcher)
        if version is not None:
            attempt = _when_changed(attempt, version)

        try:
            return self._wait(attempt, partition_id, timeout, described, log_every, what, poll_every, on_poll)
        finally:
            if watcher is not None:
                watcher.stop()

    def _wait(self, attempt: Callable[[], T | None], partition_id: str, timeout: float | None,
              described: Callable[[], str], log_every: float | None, what: str, poll_every: float | None,
              on_poll: Callable[[], None] | None) -> T:
        if timeout == 0:
            return self._store.wait_until(attempt, timeout=0, describe=described, view=partition_id)
        try:
            # The first look builds no message: it is never shown.
            return self._store.wait_until(attempt, timeout=0, describe=str, view=partition_id)
        except TimeoutError:
            pass
        deadline = None if timeout is None else time.monotonic() + timeout
        hurry = None
        if poll_every is not None and self._listing_sync is not None and self._listing_sync.has_own_poller:
            hurry = PollWhileWaiting(self._listing_sync.wait, poll_every, on_poll or (lambda: None))
        started = last_log = time.monotonic()
        try:
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
                hurry.stop()

    def look(self, read: Callable[[], T]) -> T:
        """``read()`` under the store's lock, at once (no wait, whole view or not)."""
        return self._store.read(read)

    def tags(self, partition_id: str, keys: Iterable[str]) -> dict[str, Tags]:
        """Copies of the held tags of ``keys`` (keys not held are left out)."""
        return self._store.get(partition_id, keys)

    def sync(self, timeout: float | None) -> None:
        """Return once a listing that began after the call is applied, from every poller streaming to the buffer."""
        self._store.check_open()
        if self._listing_sync is not None:
            self._listing_sync.wait(timeout)

    def view_age(self) -> float:
        """Seconds since the store was last known to be listed whole into the view (:meth:`ListingSync.fresh_since`).

        ``inf`` before the first complete poll; 0 without an own poller
        (standalone pollers only: nothing to ask).
        """
        if self._listing_sync is None or not self._listing_sync.has_own_poller:
            return 0.0
        since = self._listing_sync.fresh_since()
        return math.inf if since is None else time.monotonic() - since

    def remove(self, partition_id: str, keys: Iterable[str]) -> None:
        """Drop keys from the buffer's view; a poll still listing them does not bring them back."""
        self._store.remove(partition_id, keys)

    def quarantined(self, partition_id: str) -> list[tuple[str, str]]:
        """``(key, reason)`` of the keys of ``partition_id`` pollers leave out (the first few named)."""
        if self._table is None:
            return []
        _, named = self._table.quarantined()
        return [(key, why) for partition, key, why in named if partition == partition_id]

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


def _when_changed(attempt: Callable[[], T | None], version: Callable[[], Hashable]) -> Callable[[], T | None]:
    """``attempt`` that returns None at once while ``version()`` is the one its last run saw.

    Why: every applied poll wakes a waiting decision, and while ``sample()``
    waits the poller lists every ``wait_poll_interval`` (20 ms by default), so
    most wake-ups find nothing new in the partition (``python -m bench --only
    verl``, bench/results/verl.md: 32 polls per sample() at every K; the rule
    ran ~34 times per sample() before this, 6 after). Both reads run
    under the store's lock inside :meth:`PartitionStore.wait_until`, and a
    change takes the same lock and then notifies, so a change after the check
    still wakes the wait (no lost wake-up); a view that is not whole runs no
    attempt and records no version, so the first whole view after it decides.
    """
    seen: list[Hashable] = []  # the version of the last run; empty: never ran

    def gated() -> T | None:
        if seen and seen[0] == version():
            return None
        result = attempt()
        # Read after the run: the attempt may update what it depends on (buffer.verl records DAPO metrics first).
        seen[:] = [version()]
        return result

    return gated
