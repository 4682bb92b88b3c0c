"""Read-your-writes: wait for a listing of the buffer's own poller that began after a call.

``ReplayBuffer.sync()`` sends its poller a SYNC with a fresh token. The
poller polls at once, and every DELTA of a poll carries the highest token the
poller had received when that poll's listing began; once a complete poll
carrying our token (or a later one) is applied, the buffer reflects every
write the store had finished before the call. Concurrent callers each send a
token and the next listing answers all of them.

Standalone pollers streaming to the buffer are asked too, with the same
token: a key cleared in the store and still listed by one of them would
otherwise stay in the view until its next poll. One that goes silent past
``stale_after`` or says BYE during the wait is not waited for any more (a
view's decisions go on without it too).

A poller process that restarts during the wait never got the token (or got
it and died): the request is sent again to every new process, which is seen
when its first complete poll arrives. (The receiver also sends an unanswered
request again every second: one sent while the stream reconnected is lost.)

Two helper threads build on it for samplers that wait (:mod:`buffer.seam`,
:mod:`buffer.verl`): :class:`SyncAhead` starts the sync a decision will
need while the trainer is busy elsewhere, and :class:`PollWhileWaiting` asks
for listings more often while a decision waits; :class:`WatchWhileWaiting`
has the poller watch the keys that decision waits on, on a source that can
read a few keys cheaply (TransferQueue), and list as soon as one changed.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable

from buffer.partitions import PartitionStore
from buffer.stream import StreamReceiver

__all__ = ["ListingSync", "SyncAhead", "PollWhileWaiting", "WatchWhileWaiting"]


class ListingSync:
    """Issues SYNC tokens to the pollers streaming to a buffer and waits for the listings that answer them."""

    def __init__(self, store: PartitionStore, receiver: StreamReceiver, stream: str | None) -> None:
        self._store = store
        self._receiver = receiver
        self._stream = stream  # the buffer's own poller (None: standalone pollers only)
        self._tokens = itertools.count(1)  # next() is atomic: concurrent callers get distinct tokens
        self._answered: float | None = None  # the start of the latest wait() that returned
        self._lock = threading.Lock()

    def wait(self, timeout: float | None, standalone: bool = True) -> None:
        """Ask for a poll now and wait until one that began after this call is applied, from every poller.

        Every poller: the buffer's own, and (with ``standalone``) each
        standalone poller streaming now. ``timeout`` was checked by
        ``ReplayBuffer.sync()``.

        Raises:
            TimeoutError: no such listing within ``timeout`` (the source stalls
                or fails, or the poller cannot restart); the message says which.
            PollerCrashed: the poller is dead for good.
            BufferClosed: the buffer was closed, possibly while waiting.
        """
        token = next(self._tokens)
        started = time.monotonic()
        streams = [self._stream] if self._stream is not None else []
        if standalone:
            streams += [name for name in self._receiver.streaming() if name != self._stream]
        # stream -> the poller epochs asked; each a list so attempt() can extend it.
        asked: dict[str, list[int | None]] = {stream: [] for stream in streams}

        def attempt() -> bool | None:
            waiting = False
            for stream, epochs in asked.items():
                if self._store.synced(stream) >= token:
                    continue
                peer = self._receiver.peer_info(stream)
                if stream != self._stream and (peer is None or peer.stale or peer.bye_seq is not None):
                    continue  # a standalone poller gone: not waited for
                epoch = peer.epoch if peer is not None else None
                if not epochs or epochs[-1] != epoch:
                    # First time, or a new poller process since: it never saw the token.
                    epochs.append(epoch)
                    self._receiver.send_sync(stream, token)
                waiting = True
            return None if waiting else True

        self._store.wait_until(attempt, timeout=timeout, describe=lambda: self._describe(timeout, started, asked,
                                                                                         token))
        if self._stream is not None:
            with self._lock:
                if self._answered is None or started > self._answered:
                    self._answered = started

    def watch(self, partition: str, keys: list[str], seconds: float) -> None:
        """Have the own poller watch ``keys`` of ``partition`` for ``seconds`` (no keys: stop); a no-op without one."""
        if self._stream is not None:
            self._receiver.send_watch(self._stream, partition, keys, seconds)

    @property
    def has_own_poller(self) -> bool:
        return self._stream is not None

    def fresh_since(self) -> float | None:
        """A ``time.monotonic()`` after which the store was listed whole into the buffer; None: not yet.

        The later of two lower bounds: the start of the latest :meth:`wait`
        that returned (the listing that answered it began later), and the
        start of the own poller's latest complete listing, as the poller
        stamped it (:attr:`~buffer.peers.Peer.listed_at`: never later
        than the poll was applied). A sync answered by a listing the listing
        share held back for seconds is dated by that listing, not by the
        request: a request 2.02 s before the listing that answered it made a
        view 0.01 s old look 2.03 s old, and verl's sampler asked for one
        more listing, a whole cycle later (``docs/verl.md``).
        """
        with self._lock:
            answered = self._answered
        if self._stream is None:
            return answered
        peer = self._receiver.peer_info(self._stream)
        listed = peer.listed_at if peer is not None and peer.polls_applied > 0 else None
        if listed is None:
            return answered
        return listed if answered is None else max(answered, listed)

    def _describe(self, timeout: float | None, started: float, asked: dict[str, list[int | None]],
                  token: int) -> str:
        waited = time.monotonic() - started
        unanswered = [stream for stream in asked if self._store.synced(stream) < token]
        why = [(f"sync() timed out after {waited:.3g}s (timeout={timeout}s): no complete listing of poller "
                f"{', '.join(unanswered)} that began after the call was applied")]
        for stream in unanswered:
            peer = self._receiver.peer_info(stream)
            if peer is None:
                why.append(f"{stream} has not connected")
                continue
            why.append(f"{peer.polls_applied} poll(s) applied from {stream} in all")
            if peer.stale:
                why.append(f"{stream} has been silent past stale_after")
            if len(asked[stream]) > 1:
                why.append(f"asked {len(asked[stream])} processes of {stream} (it restarted)")
        counters = self._receiver.table
        if counters.source_stalls:
            why.append(f"kv_list() stalled {counters.source_stalls} time(s) (see stats()['source_stalls'])")
        if counters.source_errors:
            why.append(f"kv_list() failed {counters.source_errors} time(s)")
        return "; ".join(why)


class SyncAhead:
    """``sync(timeout)`` in a thread, started right after a decision's last write.

    The listing it waits for runs while the trainer trains on the batch, so
    the next decision usually finds it applied instead of waiting one listing.
    """

    def __init__(self, sync: Callable[[float | None], None], timeout: float) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(sync, timeout), name="replay-sync-ahead",
                                        daemon=True)
        self._thread.start()

    def _run(self, sync: Callable[[float | None], None], timeout: float) -> None:
        try:
            sync(timeout)
        except BaseException as exc:  # closed, crashed, stalled: the caller syncs itself and sees it
            self.error = exc

    def done(self, timeout: float | None) -> bool:
        """True once the sync succeeded (waiting up to ``timeout``)."""
        self._thread.join(timeout)
        return not self._thread.is_alive() and self.error is None


class PollWhileWaiting:
    """Asks for a listing every ``gap`` seconds (``sync``) while a decision waits; ``stop()`` when it ends.

    Between decisions the poller lists on its own schedule; a decision that
    has to wait would otherwise see its last change up to one poll interval
    late. ``on_poll`` is called after each listing asked for was applied.
    """

    # Each sync() is bounded, so a stalled source cannot keep this thread long past stop().
    _BOUND = 2.0

    def __init__(self, sync: Callable[[float | None, bool], None], gap: float, on_poll: Callable[[], None]) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sync, gap, on_poll), name="replay-wait-poll",
                                        daemon=True)
        self._thread.start()

    def _run(self, sync: Callable[[float | None, bool], None], gap: float, on_poll: Callable[[], None]) -> None:
        while not self._stopped.is_set():
            started = time.monotonic()
            try:
                sync(self._BOUND, False)  # the buffer's own poller alone: standalone ones keep their schedule
            except TimeoutError:
                continue  # a stall or a restart: the waiter's own deadline and log cover it
            except BaseException:  # closed or crashed: the waiting decision raises it itself
                return
            on_poll()
            self._stopped.wait(max(0.0, gap - (time.monotonic() - started)))

    def stop(self) -> None:
        """Ask no more; a sync() in flight ends with its listing (milliseconds) or its bound."""
        self._stopped.set()


class WatchWhileWaiting:
    """Keeps the own poller watching the keys a waiting decision waits on, until :meth:`stop`.

    :meth:`update` gives the keys (the decision computes them under the
    store's lock each time what it reads changed, so this never blocks);
    a thread sends them in a WATCH at once when they differ from the last
    sent, and again every :data:`RENEW` seconds: the poller forgets a watch
    not renewed for :data:`LASTS` seconds, so a trainer that stopped or
    died leaves nothing read on its behalf, and a restarted poller gets the
    keys within a second. :meth:`stop` ends the watch in the poller.
    """

    #: Seconds between two WATCHes of the same keys.
    RENEW = 1.0
    #: How long the poller keeps watching after a WATCH (a few renewals may be lost).
    LASTS = 3.0

    def __init__(self, send: Callable[[str, list[str], float], None], partition: str) -> None:
        self._send = send
        self._partition = partition
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
                self._send(self._partition, keys or [], self.LASTS if keys else 0.0)
                sent = keys
            self._changed.wait(self.RENEW)
            # A stop wakes the wait too (below), and ends the loop before another WATCH.
        if sent:
            self._send(self._partition, [], 0.0)

    def stop(self) -> None:
        """End the watch (the poller is told); waits for the thread briefly (it never blocks on the store)."""
        self._stopped.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(1.0)
