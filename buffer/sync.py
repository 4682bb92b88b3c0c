"""Read-your-writes: wait for a listing of the buffer's own poller that began after a call.

``ReplayBuffer.sync()`` sends its poller a SYNC with a fresh token. The
poller polls at once, and every DELTA of a poll carries the highest token the
poller had received when that poll's listing began; once a complete poll
carrying our token (or a later one) is applied, the buffer reflects every
write the store had finished before the call. Concurrent callers each send a
token and the next listing answers all of them.

A poller process that restarts during the wait never got the token (or got
it and died): the request is sent again to every new process, which is seen
when its first complete poll arrives.
"""

from __future__ import annotations

import itertools
import time

from .partitions import PartitionStore
from .stream import StreamReceiver

__all__ = ["ListingSync"]


class ListingSync:
    """Issues SYNC tokens to one poller and waits for the listings that answer them."""

    def __init__(self, store: PartitionStore, receiver: StreamReceiver, stream: str) -> None:
        self._store = store
        self._receiver = receiver
        self._stream = stream
        self._tokens = itertools.count(1)  # next() is atomic: concurrent callers get distinct tokens

    def wait(self, timeout: float | None) -> None:
        """Ask for a poll now and wait until one that began after this call is applied.

        ``timeout`` was checked by ``ReplayBuffer.sync()``.

        Raises:
            TimeoutError: no such listing within ``timeout`` (the source stalls
                or fails, or the poller cannot restart); the message says which.
            PollerCrashed: the poller is dead for good.
            BufferClosed: the buffer was closed, possibly while waiting.
        """
        token = next(self._tokens)
        started = time.monotonic()
        asked: list[int | None] = []  # the poller epoch last asked; a list so attempt() can rebind it

        def attempt() -> bool | None:
            if self._store.synced(self._stream) >= token:
                return True
            peer = self._receiver.peer_info(self._stream)
            epoch = peer.epoch if peer is not None else None
            if not asked or asked[-1] != epoch:
                # First time, or a new poller process since: it never saw the token.
                asked.append(epoch)
                self._receiver.send_sync(self._stream, token)
            return None

        self._store.wait_until(attempt, timeout=timeout, describe=lambda: self._describe(timeout, started, asked))

    def _describe(self, timeout: float | None, started: float, asked: list[int | None]) -> str:
        peer = self._receiver.peer_info(self._stream)
        waited = time.monotonic() - started
        why = [(f"sync() timed out after {waited:.3g}s (timeout={timeout}s): no complete listing of poller "
                f"{self._stream} that began after the call was applied")]
        if peer is None:
            why.append("the poller has not connected")
        else:
            why.append(f"{peer.polls_applied} poll(s) applied from it in all")
            counters = self._receiver.table
            if counters.source_stalls:
                why.append(f"kv_list() stalled {counters.source_stalls} time(s) (see stats()['source_stalls'])")
            if counters.source_errors:
                why.append(f"kv_list() failed {counters.source_errors} time(s)")
            if peer.stale:
                why.append("the poller has been silent past stale_after")
        if len(asked) > 1:
            why.append(f"asked {len(asked)} poller processes (it restarted)")
        return "; ".join(why)
