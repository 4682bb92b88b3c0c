"""What a buffer reports about itself: ``stats()`` (typed, to read) and ``metrics()`` (numbers only), and the
figures its pollers' heartbeats carry, summed over their processes (:class:`ListingFigures`).

``metrics()`` names stay stable across releases, fit for a tracker as they are (verl's, wandb, MLflow);
:mod:`buffer.prometheus` exports the same table.
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, TypedDict

if TYPE_CHECKING:
    from buffer.replay import _Core

__all__ = ["BufferStats", "ListingFigures", "Metric", "METRICS", "collect_stats"]


class BufferStats(TypedDict):
    """The result of :meth:`buffer.ReplayBuffer.stats` (the manual: docs/using.md, "Stats")."""

    poller_pid: int | None
    poller_alive: bool
    restarts: int
    start_retries: int
    source_switches: int
    epoch: int | None
    messages: int
    items_received: int
    bytes_received: int
    protocol_errors: int
    source_errors: int
    source_stalls: int
    last_message_age_s: float | None
    keys: int
    poller_rss: int | None
    endpoint: str | None
    poller_name: str | None
    auth_rejected: int
    curve: bool
    peers: int
    resyncs: int
    stale_after: float
    stale_peers: list[str]
    polls: int
    snapshots: int
    quarantined: int
    quarantined_keys: list[tuple[str, str, str]]
    view_whole: bool
    view_gap: str | None
    view_fresh: bool
    view_stale: str | None
    listings: int
    listing_seconds: float
    listing_seconds_total: float
    listing_share: float
    watch_reads: int
    watch_listings: int


@dataclass
class ListingFigures:
    """A peer's listing and watch figures (Heartbeat), summed over its poller processes (each counts from 0)."""

    listings: int = 0
    total_s: float = 0.0
    last_s: float = 0.0
    share: float = 0.0
    watch_reads: int = 0
    watch_listings: int = 0
    epoch: int | None = None
    # (listings, total_s, watch_reads, watch_listings) of the earlier processes, and of the one now.
    _earlier: tuple[float, ...] = (0, 0.0, 0, 0)
    _now: tuple[float, ...] = (0, 0.0, 0, 0)

    def report(self, epoch: int, listings: int, last_s: float, total_s: float, share: float,
               watch_reads: int = 0, watch_listings: int = 0) -> None:
        """One heartbeat's figures, from poller process ``epoch``."""
        if epoch != self.epoch:
            self._earlier = tuple(map(operator.add, self._earlier, self._now))
            self.epoch, self._now = epoch, (0, 0.0, 0, 0)
        # max(): a heartbeat never takes a counter back.
        self._now = tuple(map(max, self._now, (listings, total_s, watch_reads, watch_listings)))
        listed, self.total_s, reads, brought = map(operator.add, self._earlier, self._now)
        self.listings, self.watch_reads, self.watch_listings = int(listed), int(reads), int(brought)
        self.last_s, self.share = last_s, share


def collect_stats(core: _Core) -> BufferStats:
    """The stats of an open buffer's core."""
    receiver = core.receiver
    table = receiver.table  # the stream's counters live in its peer state machine
    supervisor = core.supervisor
    process = supervisor.process if supervisor else None
    peer = receiver.peer_info(core.name)
    last = table.last_message_at
    quarantined, quarantined_keys = table.quarantined()
    gap = core.store.view_gap()
    stale = core.store.view_stale()
    return {
        "poller_pid": process.pid if process else None,
        "poller_alive": bool(process and process.is_alive()),
        "restarts": core.budget.total,
        "start_retries": supervisor.start_retries if supervisor else 0,
        "source_switches": supervisor.switches if supervisor else 0,
        "epoch": process.epoch if process else None,
        "messages": table.messages,
        "items_received": table.items_received,
        "bytes_received": table.bytes_received,
        "protocol_errors": table.protocol_errors,
        "source_errors": table.source_errors,
        "source_stalls": table.source_stalls,
        "last_message_age_s": None if last is None else time.monotonic() - last,
        "keys": core.store.key_count(),
        "poller_rss": peer.rss if peer else None,
        "endpoint": core.endpoint,
        "poller_name": core.name if core.source is not None else None,
        "auth_rejected": receiver.auth_rejected,
        "curve": receiver.curve is not None,
        # Pollers connected that have not said BYE (the state of those that did is kept for a restart).
        "peers": sum(1 for peer in list(table.peers.values()) if peer.bye_seq is None),
        "resyncs": table.resyncs_requested,
        "stale_after": receiver.stale_after,
        "stale_peers": table.stale_peers(time.monotonic()),
        "polls": peer.polls_applied if peer else 0,
        "snapshots": peer.snapshots_applied if peer else 0,
        "quarantined": quarantined,
        "quarantined_keys": quarantined_keys,
        "view_whole": gap is None,
        "view_gap": gap,
        "view_fresh": stale is None,
        "view_stale": stale,
        # The buffer's own poller's full listings of its source (poller.duty), as its last heartbeat said.
        "listings": peer.listing.listings if peer else 0,
        "listing_seconds": peer.listing.last_s if peer else 0.0,
        "listing_seconds_total": peer.listing.total_s if peer else 0.0,
        "listing_share": peer.listing.share if peer else 0.0,
        # Its watch of the keys a waiting decision waits on (poller.watch), as its last heartbeat said.
        "watch_reads": peer.listing.watch_reads if peer else 0,
        "watch_listings": peer.listing.watch_listings if peer else 0,
    }


class Metric(NamedTuple):
    """One metric: its stable dotted name, whether it only grows, what it means, the ``stats()`` key it reads."""

    name: str
    kind: Literal["counter", "gauge"]
    help: str
    key: str

    def read(self, stats: BufferStats) -> float:
        """The number: a flag as 0 or 1, a list by its length, nothing (``None``) as NaN."""
        value = stats[self.key]  # type: ignore[literal-required]
        if isinstance(value, list):
            return float(len(value))
        return math.nan if value is None else float(value)


#: Every metric, in a fixed order. Names never change meaning; new ones may be added.
METRICS: tuple[Metric, ...] = (
    Metric("replay.keys", "gauge", "keys held by the buffer", "keys"),
    Metric("replay.poller.alive", "gauge", "1 while the buffer's own poller process runs", "poller_alive"),
    Metric("replay.poller.restarts", "counter", "restarts of the buffer's own poller", "restarts"),
    Metric("replay.poller.polls", "counter", "complete listings applied from the buffer's own poller", "polls"),
    Metric("replay.poller.snapshots", "counter", "full listings among the polls", "snapshots"),
    Metric("replay.poller.rss_bytes", "gauge", "resident memory of the buffer's own poller (NaN: not reported)",
           "poller_rss"),
    Metric("replay.source.errors", "counter", "failed kv_list() calls reported by pollers", "source_errors"),
    Metric("replay.source.stalls", "counter", "kv_list() calls past their deadline", "source_stalls"),
    Metric("replay.stream.messages", "counter", "messages received from pollers", "messages"),
    Metric("replay.stream.items", "counter", "keys received (upserts and deletes)", "items_received"),
    Metric("replay.stream.bytes", "counter", "bytes received from pollers", "bytes_received"),
    Metric("replay.stream.protocol_errors", "counter", "messages refused by the decoder", "protocol_errors"),
    Metric("replay.stream.resyncs", "counter", "full snapshots asked of pollers after a gap", "resyncs"),
    Metric("replay.stream.auth_rejected", "counter", "handshakes refused for want of an allowed CURVE key",
           "auth_rejected"),
    Metric("replay.stream.peers", "gauge", "pollers connected that have not said BYE", "peers"),
    Metric("replay.stream.stale_peers", "gauge", "pollers silent longer than stale_after", "stale_peers"),
    Metric("replay.stream.last_message_age_seconds", "gauge", "seconds since the last message (NaN: none yet)",
           "last_message_age_s"),
    Metric("replay.poller.start_retries", "counter",
           "restarts of the buffer's own poller refused because its store could not be reached", "start_retries"),
    Metric("replay.stream.quarantined", "gauge",
           "keys left out of the stream because the wire cannot carry their tags (stats()['quarantined_keys'])",
           "quarantined"),
    Metric("replay.view.whole", "gauge",
           "1 while every partition's view reflects complete listings (decisions are made only then)", "view_whole"),
    Metric("replay.view.fresh", "gauge",
           "1 while the store answers and its last complete listing is at most max_view_age old "
           "(decisions need it too)", "view_fresh"),
    Metric("replay.source.listings", "counter", "full listings of the source by the buffer's own poller", "listings"),
    Metric("replay.source.last_listing_seconds", "gauge", "seconds the last full listing of the source took",
           "listing_seconds"),
    # A counter of seconds: Prometheus shows it as replay_source_listing_seconds_total.
    Metric("replay.source.listing_seconds", "counter", "seconds spent in full listings of the source",
           "listing_seconds_total"),
    Metric("replay.source.listing_share", "gauge",
           "share of the wall clock spent in full listings of the source lately (bounded by listing_share)",
           "listing_share"),
    Metric("replay.source.watch_reads", "counter",
           "targeted reads of the keys a waiting decision waits on (a source without a change feed that can)",
           "watch_reads"),
    Metric("replay.source.watch_listings", "counter",
           "listings of the source brought forward by a change the watch saw", "watch_listings"),
    Metric("replay.poller.source_switches", "counter",
           "restarts of the buffer's own poller on a replaced store (switch_source; not counted in restarts)",
           "source_switches"),
)
