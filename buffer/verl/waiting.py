"""How a buffer.verl call waits as verl's own sampler does: the listings it asks for and the keys it watches.

verl's sampler lists the store every ``poll_interval`` while a call waits. :func:`decide` keeps that schedule
(:func:`_poll_while_waiting`, from the wait's start), has the own poller watch the prompts in flight
(:class:`WatchWhileWaiting`: a change seen brings a listing forward, no sooner than ``poll_interval`` after the
last one it brought forward), and skips the wake-ups that find the groups unchanged.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Hashable, TypeVar

from buffer.sampling import SamplingAccess

__all__ = ["WatchWhileWaiting", "decide"]

T = TypeVar("T")


def decide(sampling: SamplingAccess, attempt: Callable[[], T | None], *, partition_id: str, timeout: float | None,
           describe: Callable[[], str], log_every: float | None, what: str, poll_every: float,
           on_poll: Callable[[], None], version: Callable[[], Hashable] | None,
           watch: Callable[[], list[str]]) -> T:
    """:meth:`SamplingAccess.decide`, waiting as verl's sampler waits.

    ``version`` (read under the lock, changing whenever anything ``attempt`` reads does) skips wake-ups that find
    the last run's version (None: every wake-up runs ``attempt``). While waiting, the own poller is asked for a
    listing every ``poll_every`` seconds from the wait's start (``on_poll`` after each). ``watch`` (run under the
    lock after an attempt that found nothing): at most :data:`~poller.wire.protocol.MAX_WATCH_KEYS` keys the
    decision waits on, which the poller reads cheaply and lists as soon as one changed, no more often than
    ``poll_every`` (:mod:`poller.watch`), on a source that can.
    """
    own = sampling.own_poller
    watcher = None
    if own is not None and timeout != 0:
        watcher = WatchWhileWaiting(own.watch, partition_id, poll_every)
        attempt = _watching(attempt, watch, watcher)

    def on_wait() -> Callable[[], None]:
        if own is None:
            return lambda: None
        # set: stop asking; a sync() in flight ends with its listing (milliseconds) or its bound
        return _poll_while_waiting(own.wait, poll_every, on_poll, own.view_age).set

    try:
        return sampling.decide(_when_changed(attempt, version), partition_id=partition_id, timeout=timeout,
                           describe=describe, log_every=log_every, what=what, on_wait=on_wait)
    finally:
        if watcher is not None:
            watcher.stop()


def _watching(attempt: Callable[[], T | None], watch: Callable[[], list[str]],
              watcher: WatchWhileWaiting) -> Callable[[], T | None]:
    """``attempt`` that, when it finds nothing, hands the keys it waits on to ``watcher`` (under the same lock)."""
    def watched() -> T | None:
        result = attempt()
        if result is None:
            watcher.update(watch())
        return result

    return watched


def _when_changed(attempt: Callable[[], T | None], version: Callable[[], Hashable] | None) -> Callable[[], T | None]:
    """``attempt`` that returns None at once while ``version()`` is the one its last run saw: most
    wake-ups find nothing new (verl's rule ran ~34 times per ``sample()``, 6 with this). Both reads run
    under the store's lock, which a change takes before it notifies, so no wake-up is lost."""
    if version is None:
        return attempt
    seen: list[Hashable] = []  # the version of the last run; empty: never ran

    def gated() -> T | None:
        if seen and seen[0] == version():
            return None
        result = attempt()
        seen[:] = [version()]  # read after the run: an attempt may update what it depends on
        return result

    return gated


# Each sync() of _poll_while_waiting is bounded, so a stalled source cannot keep its thread long past the stop.
_POLL_BOUND = 2.0
# A slot of _poll_while_waiting is spared when a listing began within this share of its gap before it.
_SLOT_SPARED = 0.1


def _poll_while_waiting(sync: Callable[[float | None, bool], None], gap: float, on_poll: Callable[[], None],
                        view_age: Callable[[], float]) -> threading.Event:
    """Ask for a listing every ``gap`` seconds from now (``sync``, then ``on_poll``), in a thread, until the event is
    set: the listings verl's sampler makes while it waits, at the same times, so a waiting decision never sees a
    change later than with it. A slot is skipped when a listing began within :data:`_SLOT_SPARED` of it (one a
    watched change brought forward: listing again would show almost nothing more)."""
    stopped = threading.Event()
    anchor = time.monotonic()

    def run() -> None:
        slot = 1
        while not stopped.is_set():
            due = anchor + slot * gap - time.monotonic()
            if due > 0:
                stopped.wait(due)
                continue
            if view_age() >= gap * _SLOT_SPARED:
                try:
                    sync(_POLL_BOUND, False)  # the buffer's own poller alone: standalone ones keep their schedule
                except TimeoutError:
                    pass  # a stall or a restart: the waiter's own deadline and log cover it
                except BaseException:  # closed or crashed: the waiting decision raises it itself
                    return
                else:
                    on_poll()
            # The next slot still ahead (a slow listing may have spanned several).
            slot = max(slot + 1, math.floor((time.monotonic() - anchor) / gap) + 1)

    threading.Thread(target=run, name="replay-wait-poll", daemon=True).start()
    return stopped


class WatchWhileWaiting:
    """Keeps the own poller watching the keys a waiting decision waits on, until :meth:`stop`.

    :meth:`update` (under the store's lock: it never blocks) gives the keys; a thread sends them in a WATCH
    when they changed and every :data:`RENEW` seconds, as the poller forgets a watch after :data:`LASTS`
    seconds (a dead trainer leaves nothing read on its behalf; a restarted poller has the keys within a second).
    """

    #: Seconds between two WATCHes of the same keys.
    RENEW = 1.0
    #: How long the poller keeps watching after a WATCH (a few renewals may be lost).
    LASTS = 3.0

    def __init__(self, send: Callable[[str, list[str], float, float], None], partition: str, every: float) -> None:
        self._send = send
        self._partition = partition
        self._every = every  # the least time between two listings a change it sees brings forward
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
                self._send(self._partition, keys or [], self.LASTS if keys else 0.0, self._every)
                sent = keys
            self._changed.wait(self.RENEW)  # a stop wakes it too, ending the loop before another WATCH
        if sent:
            self._send(self._partition, [], 0.0, self._every)

    def stop(self) -> None:
        """End the watch (the poller is told); waits for the thread briefly (it never blocks on the store)."""
        self._stopped.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(1.0)
