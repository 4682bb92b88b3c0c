"""What a poller's full listings of its source cost, as the buffer sums them (``stats()["listing_*"]``).

A poller reports its listing duty cycle (:mod:`poller.duty`) in every
heartbeat; its figures start from 0 in each process, so the buffer keeps the
totals of the earlier processes of the same stream to report counters that
never go back across restarts.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

__all__ = ["ListingFigures"]


@dataclass
class ListingFigures:
    """What a peer's full listings cost, summed over its poller processes (a restart starts from 0)."""

    listings: int = 0
    total_s: float = 0.0
    last_s: float = 0.0
    share: float = 0.0
    # The watch (poller.polling): targeted reads of waited-on keys, and listings a change seen there brought forward.
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
