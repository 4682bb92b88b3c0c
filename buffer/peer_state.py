"""One poller's stream as the receiver keeps it: :class:`Peer`.

:class:`~buffer.peers.PeerTable` holds one per identity and moves its
sequence state (epoch, next seq, resync, BYE, liveness) as messages arrive;
what the poller says of itself in heartbeats (memory, quarantined keys,
listings, source stalls) the record keeps with :meth:`Peer.report`. The
receiver's waits (:mod:`buffer.stream`) and ``stats()`` read it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from buffer.listings import ListingFigures
from poller.wire.messages import Heartbeat

__all__ = ["Peer"]


@dataclass
class Peer:
    """One stream's state; ``stream`` is its name (the identity the poller connects with)."""

    stream: str
    epoch: int | None = None
    next_seq: int = 0
    awaiting_resync: bool = False
    contiguous: bool = False
    bye_seq: int | None = None
    pid: int | None = None
    rss: int = 0
    polls_applied: int = 0
    snapshots_applied: int = 0
    # When the listing of its last complete poll began, on this process's time.monotonic() (None: no poll yet):
    # the poller's stamp, never later than the poll was applied (peers.Peers._on_delta).
    listed_at: float | None = None
    last_seen: float = field(default_factory=time.monotonic)
    resync_asked_at: float = 0.0
    stale: bool = False
    # The source-stall count this peer last reported, and in which epoch
    # (the count restarts with every poller process).
    stalls: int = 0
    stalls_epoch: int | None = None
    # Keys this peer leaves out of the stream (poller.quarantine), as its last heartbeat said.
    quarantined: int = 0
    quarantined_keys: list[tuple[str, str, str]] = field(default_factory=list)
    # Full listings of its source (poller.duty), as its heartbeats said: the
    # totals of its earlier processes, and those of the process now (epoch).
    listing: ListingFigures = field(default_factory=ListingFigures)

    def report(self, epoch: int, beat: Heartbeat) -> int:
        """Keep what heartbeat ``beat`` of poller process ``epoch`` says; return the source stalls new in it."""
        self.rss = beat.rss
        if beat.quarantined is not None:  # None from older pollers
            self.quarantined = beat.quarantined
            self.quarantined_keys = [(p, k, why) for p, k, why in beat.quarantined_keys or ()]
        if beat.listings is not None:  # None from older pollers
            self.listing.report(epoch, beat.listings, beat.listing_s or 0.0, beat.listing_total_s or 0.0,
                                beat.listing_share or 0.0, beat.watch_reads or 0, beat.watch_listings or 0)
        stalls = beat.source_stalls  # None from older pollers
        if stalls is None:
            return 0
        if self.stalls_epoch != epoch:
            self.stalls_epoch, self.stalls = epoch, 0
        if stalls <= self.stalls:
            return 0
        new, self.stalls = stalls - self.stalls, stalls
        return new
