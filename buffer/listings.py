"""What a poller's full listings of its source cost, as the buffer sums them (``stats()["listing_*"]``).

A poller reports its listing duty cycle (:mod:`poller.duty`) in every
heartbeat; its figures start from 0 in each process, so the buffer keeps the
totals of the earlier processes of the same stream to report counters that
never go back across restarts.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ListingFigures"]


@dataclass
class ListingFigures:
    """What a peer's full listings cost, summed over its poller processes (a restart starts from 0)."""

    listings: int = 0
    total_s: float = 0.0
    last_s: float = 0.0
    share: float = 0.0
    epoch: int | None = None
    _earlier: tuple[int, float] = (0, 0.0)
    _now: tuple[int, float] = (0, 0.0)

    def report(self, epoch: int, listings: int, last_s: float, total_s: float, share: float) -> None:
        """One heartbeat's figures, from poller process ``epoch``."""
        if epoch != self.epoch:
            self._earlier = (self._earlier[0] + self._now[0], self._earlier[1] + self._now[1])
            self.epoch, self._now = epoch, (0, 0.0)
        # max(): a heartbeat never takes a counter back.
        self._now = (max(self._now[0], listings), max(self._now[1], total_s))
        self.listings = self._earlier[0] + self._now[0]
        self.total_s = self._earlier[1] + self._now[1]
        self.last_s, self.share = last_s, share
