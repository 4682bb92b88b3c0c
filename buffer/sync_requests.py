"""The SYNCs the receiver asked of its pollers, sent again until a complete poll answers them.

``ReplayBuffer.sync()`` (:mod:`buffer.sync`) asks its poller for a listing
through the receiver thread, which builds the SYNC with
:meth:`~buffer.peers.PeerTable.sync`. A SYNC sent while the route to the
poller was down (a reconnect) is lost, so :class:`SyncRequests` keeps the
highest token asked of each poller until the store says a complete poll
answered it, and :meth:`~buffer.peers.PeerTable.tick` sends it again every
:data:`SYNC_RETRY_S` meanwhile. It also keeps the partitions every SYNC to a
poller names (``ReplayBuffer.include_partitions``).
"""

from __future__ import annotations

from typing import Callable, Sequence

from poller.wire.messages import Sync

__all__ = ["SyncRequests", "SYNC_RETRY_S"]

#: How long a SYNC may stay unanswered before it is sent again: one sent
#: while the route to the poller was down (a reconnect) is lost.
SYNC_RETRY_S = 1.0


class SyncRequests:
    """Per poller identity: the highest SYNC token not yet answered, and the partitions each SYNC names."""

    def __init__(self) -> None:
        # identity -> (highest SYNC token asked of it and not yet answered, when it was last sent).
        self._asked: dict[bytes, tuple[int, float]] = {}
        # identity -> the partitions every SYNC to it names (see include_partitions).
        self._partitions: dict[bytes, list[str]] = {}

    def ask(self, identity: bytes, token: int, now: float) -> Sync:
        """The SYNC to send ``identity`` at ``now``: ``token``, or a higher one it was asked and has not answered."""
        wanted = self._asked.get(identity)
        token = max(token, wanted[0]) if wanted else token
        self._asked[identity] = (token, now)
        return Sync(token, self._partitions.get(identity))

    def include_partitions(self, identity: bytes, partition_ids: Sequence[str]) -> None:
        """Every SYNC to ``identity`` from now on names these partitions too (a set that only grows).

        The poller then lists them before it answers the token, whichever of
        its processes gets it: a request asked again after a restart names
        them again. Called directly, not through the receiver's command
        queue: the dict entry is replaced in one GIL-atomic step.
        """
        held = self._partitions.get(identity, [])
        self._partitions[identity] = held + sorted(set(partition_ids) - set(held))

    def due(self, now: float, answered: Callable[[bytes], int]) -> list[tuple[bytes, int]]:
        """The (identity, token) requests to send again at ``now``; those ``answered`` are forgotten.

        ``answered(identity)`` is the highest token a complete poll of that
        poller answered.
        """
        due = []
        for identity, (token, sent_at) in list(self._asked.items()):
            if answered(identity) >= token:
                del self._asked[identity]
            elif now - sent_at > SYNC_RETRY_S:
                due.append((identity, token))
        return due
