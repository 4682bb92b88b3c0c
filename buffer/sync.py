"""Read-your-writes over the stream: the transport side of the sampling's :class:`~buffer.sampling.Listings`.

``sync()`` sends each poller a SYNC with a fresh token; the poller polls at once, and each DELTA carries
the highest token it had when that poll's listing began. Once a complete poll carrying our token (or a
later one) is applied, every write the store had finished before the call is reflected; one listing
answers concurrent callers. Standalone pollers are asked too (a key cleared in the store would otherwise
stay in the view until their next poll) unless silent past ``stale_after`` or gone (BYE). A poller
process that restarts during the wait never got the token, so each new one is asked again.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING

from buffer.store import PartitionStore

if TYPE_CHECKING:  # the receiver is handed in by the core: only its type is named here
    from buffer.stream import StreamReceiver

__all__ = ["ListingSync", "SyncRequest"]


class ListingSync:
    """:class:`~buffer.sampling.Listings` over a buffer's receiver: SYNC tokens and the listings that answer them."""

    def __init__(self, store: PartitionStore, receiver: StreamReceiver, stream: str | None) -> None:
        self._store = store
        self._receiver = receiver
        self._stream = stream  # the buffer's own poller (None: standalone pollers only)
        self._answered: float | None = None  # the start of the latest wait() that returned
        self._lock = threading.Lock()

    def wait(self, timeout: float | None, standalone: bool = True) -> None:
        """A ``TimeoutError`` says why no listing was applied."""
        request = self.begin(standalone)
        self._store.wait_until(request.attempt, timeout=timeout, describe=lambda: request.describe(timeout))
        self.answered(request)

    def begin(self, standalone: bool = True) -> SyncRequest:
        """A new request: a fresh token, for the own poller (and the standalone ones streaming now); nothing sent
        yet (:meth:`SyncRequest.attempt` sends)."""
        streams = [self._stream] if self._stream is not None else []
        if standalone:
            streams += [name for name in self._receiver.streaming() if name != self._stream]
        return SyncRequest(self, self._store.issue_token(), self._store.clock(), streams, standalone)

    def answered(self, request: SyncRequest) -> None:
        """``request`` was answered: the view is as new as its start (:meth:`view_age`)."""
        if self._stream is not None:
            with self._lock:
                if self._answered is None or request.started > self._answered:
                    self._answered = request.started

    def silence(self) -> str | None:
        """How long the store has not answered the listing the own poller has under way (None: one second or less,
        or none under way, as of its last heartbeat)."""
        peer = self._receiver.peer_info(self._stream) if self._stream is not None else None
        if peer is None or peer.call_s <= 1.0:
            return None
        running = peer.call_s + max(0.0, self._store.clock() - peer.call_heard)
        return f"the store has not answered the listing poller {self._stream} began {running:.1f}s ago"

    def watch_reads(self) -> int:
        peer = self._receiver.peer_info(self._stream) if self._stream is not None else None
        return peer.listing.watch_reads if peer is not None else 0

    def watch(self, partition: str, keys: list[str], seconds: float, every: float) -> None:
        if self._stream is not None:
            self._receiver.send_watch(self._stream, partition, keys, seconds, every)

    def quarantined(self, partition_id: str) -> list[tuple[str, str]]:
        _, named = self._receiver.table.quarantined()
        return [(key, why) for partition, key, why in named if partition == partition_id]

    @property
    def has_own_poller(self) -> bool:
        return self._stream is not None

    def view_age(self) -> float:
        """Since the later of the start of the latest :meth:`wait` that returned and the start of the own
        poller's latest complete listing (:attr:`~buffer.stream.Peer.listed_at`): a sync answered by a listing
        the listing share held back is dated by that listing, not the request. 0 without an own poller."""
        if self._stream is None:
            return 0.0
        with self._lock:
            answered = self._answered
        peer = self._receiver.peer_info(self._stream)
        listed = peer.listed_at if peer is not None and peer.polls_applied > 0 else None
        since = max((since for since in (answered, listed) if since is not None), default=None)
        return math.inf if since is None else self._store.clock() - since



class SyncRequest:
    """One ``sync()``: its token, the pollers asked, and whether a complete listing of each answered.

    :meth:`attempt` is what :meth:`ListingSync.wait` waits on under the store's lock (a simulation of the
    buffer steps it directly): it (re)sends the token to each poller process not asked yet, and is true
    once every poller still streaming answered.
    """

    def __init__(self, sync: ListingSync, token: int, started: float, streams: list[str], standalone: bool) -> None:
        self._sync = sync
        self.standalone = standalone
        self.token = token
        self.started = started
        # stream -> the poller epochs asked; a new epoch since (a restart) never saw the token.
        self.asked: dict[str, list[int | None]] = {stream: [] for stream in streams}

    def attempt(self) -> bool | None:
        """True once answered; None while waiting (sending the token where a new process did not get it).

        A standalone poller that fell silent (past ``stale_after``, or BYE) is not waited for, unless no poller
        asked has answered at all (nothing was read back). Nor is a view any silent poller alone lists keys of
        (they cannot be read back): until it lists again or is withdrawn (``max_view_age``).
        """
        sync = self._sync
        waiting = answered = gone = False
        if self.standalone:  # a poller streaming again (or first) since the call is asked too
            for stream in sync._receiver.streaming():
                self.asked.setdefault(stream, [])
        if sync._store.unvouched():
            waiting = True
        for stream, epochs in self.asked.items():
            if sync._store.synced(stream) >= self.token:
                answered = True
                continue
            peer = sync._receiver.peer_info(stream)
            if stream != sync._stream and (peer is None or peer.stale or peer.bye_seq is not None):
                gone = True
                continue
            epoch = peer.epoch if peer is not None else None
            if not epochs or epochs[-1] != epoch:
                # First time, or a new poller process since: it never saw the token.
                epochs.append(epoch)
                sync._receiver.send_sync(stream, self.token)
            waiting = True
        return None if waiting or (gone and not answered) else True

    def describe(self, timeout: float | None) -> str:
        sync = self._sync
        waited = sync._store.clock() - self.started
        unanswered = [stream for stream in self.asked if sync._store.synced(stream) < self.token]
        why = [(f"sync() timed out after {waited:.3g}s (timeout={timeout}s): no complete listing of poller "
                f"{', '.join(unanswered)} that began after the call was applied")]
        for stream in unanswered:
            peer = sync._receiver.peer_info(stream)
            if peer is None:
                why.append(f"{stream} has not connected")
                continue
            why.append(f"{peer.polls_applied} poll(s) applied from {stream} in all")
            if peer.stale or peer.bye_seq is not None:
                why.append(f"{stream} has been silent past stale_after" if peer.stale else f"{stream} said BYE")
            if len(self.asked[stream]) > 1:
                why.append(f"asked {len(self.asked[stream])} processes of {stream} (it restarted)")
        stale = sync._store.view_stale() or sync.silence()
        if stale is not None:
            why.append(stale)
        for stream in sync._store.unvouched():
            why.append(f"poller {stream} is silent and alone lists {len(sync._store.lonely(stream))} key(s) of the "
                       f"view, which cannot be read back until it lists again or is withdrawn (max_view_age)")
        counters = sync._receiver.table
        if counters.source_stalls:
            why.append(f"kv_list() stalled {counters.source_stalls} time(s) (see stats()['source_stalls'])")
        if counters.source_errors:
            why.append(f"kv_list() failed {counters.source_errors} time(s)")
        return "; ".join(why)
