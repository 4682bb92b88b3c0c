"""The one interface between a buffer and its sampling policies: what a policy uses of a buffer, and what it
implements.

A sampling policy (``ReplayBuffer.sample``'s :mod:`buffer.steps`, :mod:`buffer.verl`) keeps its own index
from the store's changes (:class:`Policy`, :class:`BulkPolicy`) and decides on it through
:class:`SamplingAccess` alone, which knows no transport: it asks the pollers through :class:`Listings`
(:class:`buffer.sync.ListingSync`), so sampling means the same on every source.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Protocol, TypeVar

from buffer.store import PartitionStore
from poller.wire.vocabulary import Tags

__all__ = ["BulkPolicy", "Listings", "Policy", "SamplingAccess"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Policy(Protocol):
    """Sampling semantics over a :class:`~buffer.store.PartitionStore`: indexes kept from changes."""

    def on_change(self, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        """Called under the store's lock after one key changed (old None: added; new None: dropped).
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
    """What :class:`SamplingAccess` asks of the pollers streaming to the store (the transport side implements it)."""

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


class SamplingAccess:
    """What a sampling policy uses of a buffer: its store under lock, read-your-writes, deadline waits, clearing."""

    def __init__(self, store: PartitionStore, listings: Listings | None = None) -> None:
        self._store = store
        self._listings = listings

    def attach(self, policy: Policy) -> None:
        """Attach ``policy``; it first sees every key held as an addition."""
        self._store.attach(policy)

    def decide(self, attempt: Callable[[], T | None], *, partition_id: str, timeout: float | None,
               describe: Callable[[], str], log_every: float | None = None, what: str = "a decision",
               on_wait: Callable[[], Callable[[], None]] | None = None) -> T:
        """``attempt()``'s first non-None result, on a whole view of ``partition_id``, waking on every change.

        ``attempt`` runs under the store's lock and must not block. ``log_every``: log ``describe()`` at INFO that
        often. ``on_wait`` is called once the first look found nothing and the decision waits; what it returns is
        called when the decision ends (a policy's own helpers while it waits: :mod:`buffer.verl.waiting`).

        Raises:
            TimeoutError: at the deadline, with ``describe()`` (and the partition's quarantined keys).
            PollerCrashed: the poller is dead for good.
            BufferClosed: the buffer was closed, possibly while waiting.
        """
        def described() -> str:
            return describe() + self._quarantine_note(partition_id)

        stop_waiting: Callable[[], None] | None = None
        try:
            try:
                # The first look builds no message unless it is the only one.
                return self._store.wait_until(attempt, timeout=0, describe=described if timeout == 0 else str,
                                              view=partition_id)
            except TimeoutError:
                if timeout == 0:
                    raise
            deadline = None if timeout is None else time.monotonic() + timeout
            if on_wait is not None:
                stop_waiting = on_wait()
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
            if stop_waiting is not None:
                stop_waiting()

    @property
    def own_poller(self) -> Listings | None:
        """The listings of the buffer's own poller, to ask while a decision waits (None: it has none)."""
        return self._listings if self._listings is not None and self._listings.has_own_poller else None

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
