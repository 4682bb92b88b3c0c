"""The poller's polling thread: read the source and diff (:mod:`poller.diff`), encode, hand over to the Outbox.

Off the control path: ``kv_list()`` may block forever (TransferQueue's client has no timeout), and the control
loop in :mod:`poller.worker` must still answer STOP at once. The thread only produces encoded DELTA/ERROR bodies
and hands them straight to the :class:`~poller.link.Outbox`; the control loop owns the socket and stamps sequence
numbers.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

from poller.common.checks import DEFAULT_LISTING_SHARE
from poller.diff import Diff, Sent
from poller.duty import ListingDuty
from poller.quarantine import Quarantine
from poller.reader import ListingReader
from poller.sources.contract import Source, SourceStall
from poller.watch import KeyWatch
from poller.wire.protocol import Error, Kind, Limits, Piece, encode_body, fit_text, iter_encode_delta

__all__ = ["PollingThread", "CallStalls", "PollFigures", "MAX_FAILURES", "BACKOFF_BASE", "BACKOFF_CAP"]

logger = logging.getLogger(__name__)

#: The most a standalone poller's first listing waits for the buffer to admit it (its first ACK).
ADMISSION_WAIT = 2.0
#: Failed calls in a row that end the poller (PollerCrashed in the trainer); a stall is no failure.
MAX_FAILURES = 5
#: After the n-th failed call in a row the next comes min(BACKOFF_BASE * 2 ** (n - 1), BACKOFF_CAP) s later.
BACKOFF_BASE = 0.1
BACKOFF_CAP = 5.0


class PollFigures(NamedTuple):
    """What a heartbeat says of the polling thread, read at once."""

    polls: int
    source_errors: int
    source_stalls: int
    stalled_s: float
    quarantined: int
    quarantined_keys: list[list[str]]
    listings: int
    listing_s: float
    listing_total_s: float
    listing_share: float
    watch_reads: int
    watch_listings: int


class CallStalls:
    """The source call under way, and the calls counted as stalled: a call the source gave up on
    (:class:`~poller.sources.contract.SourceStall`), or one running past ``timeout`` (:meth:`check`, each tick of
    the control loop: a blocked call never raises). Each call is counted once, whichever path sees it first."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        #: Calls counted as stalled so far (read by the control loop for heartbeats).
        self.count = 0
        # (call number, monotonic start) of the call under way, in one assignment: never mixed up.
        self._current: tuple[int, float] | None = None
        self._calls = 0
        self._lock = threading.Lock()
        self._counted = 0  # number of the last call counted as stalled
        self._episode: tuple[float, int] | None = None  # (started, stalled calls) while stalled

    @property
    def call_started(self) -> float | None:
        """Monotonic start of the call under way, if any."""
        current = self._current
        return None if current is None else current[1]

    def running_for(self) -> float:
        """Seconds the call under way has been running (0 if none)."""
        started = self.call_started
        return 0.0 if started is None else time.monotonic() - started

    def next_call(self) -> int:
        """The number of the next call."""
        self._calls += 1
        return self._calls

    def begin(self, call: int, began: float) -> None:
        self._current = (call, began)

    def end(self) -> None:
        self._current = None

    def check(self) -> None:
        """Count the call under way as stalled once past ``timeout``."""
        current = self._current
        if current is None or self.timeout is None:
            return
        call, started = current
        running = time.monotonic() - started
        if running >= self.timeout:
            self.stalled(call, f"kv_list() has not returned for {running:.3g}s (stall timeout {self.timeout:g}s)")

    def stalled(self, call: int, why: str) -> None:
        """Count call ``call`` as stalled (once), logging the first of an episode."""
        with self._lock:
            if self._counted == call:
                return  # this call was already counted (by the other path)
            self._counted = call
            self.count += 1
            first = self._episode is None
            since, count = self._episode or (time.monotonic(), 0)
            self._episode = (since, count + 1)
        if first:
            logger.warning("source stall: %s; polling goes on (logged once until kv_list() answers again)", why)
        else:
            logger.debug("source stall #%d: %s", self.count, why)

    def answered(self) -> None:
        """The source answered (a listing or an error): a stall episode ends."""
        with self._lock:
            episode, self._episode = self._episode, None
        if episode is not None:
            logger.info("kv_list() answers again after %d stalled call(s) over %.3gs",
                        episode[1], time.monotonic() - episode[0])


def _error_body(exc: BaseException, *, fatal: bool, count: int, limits: Limits | None = None) -> bytes:
    return encode_body(Kind.ERROR, Error(
        type=fit_text(type(exc).__name__, limits),
        message=fit_text(str(exc), limits),
        traceback=fit_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), limits),
        fatal=fatal,
        count=count,
    ))


class PollingThread(threading.Thread):
    """Polls the source every ``poll_interval``, start to start, within ``listing_share`` (:mod:`poller.duty`).

    ``hand_over(kind, body, starts_snapshot, stopping)`` is :meth:`poller.link.Outbox.emit_from_thread`: it queues a
    message for the control loop, blocking while the outbox is full, and returns False once ``stopping`` is set.
    A daemon: if ``kv_list()`` never returns, the process exits without it. A *source stall* (the source raised
    :class:`~poller.sources.contract.SourceStall`, or :meth:`CallStalls.check` found the call past ``stall_timeout``)
    is counted once, not a failure. A SYNC is answered by the next listing the share allows;
    STOP ends any wait; a change the watch saw (:class:`~poller.watch.KeyWatch`) brings one forward. After a
    stalled call the next comes ``poll_interval`` later, after a failed one the backoff.
    """

    def __init__(self, source: Source, hand_over: Callable[[Kind, bytes, bool, threading.Event], bool], *,
                 poll_interval: float,
                 chunk_items: int = 4096, max_frame_bytes: int = 64 * 1024 * 1024,
                 stall_timeout: float | None = None, limits: Limits | None = None,
                 listing_share: float = DEFAULT_LISTING_SHARE,
                 admitted: threading.Event | None = None) -> None:
        super().__init__(name="poller-source", daemon=True)
        self._reader = ListingReader(source, listing_share=listing_share, stall_timeout=stall_timeout)
        self._hand_over = hand_over
        self.poll_interval = poll_interval
        self.chunk_items = chunk_items
        self.max_frame_bytes = max_frame_bytes
        self.limits = limits
        self.stopping = threading.Event()
        #: Set by the control loop at the buffer's first ACK; the first poll waits for it (None: no wait).
        self.admitted = admitted
        self._wake = threading.Event()
        self._resync = threading.Event()
        # Read by the control loop for heartbeats (plain ints, safe under the GIL): figures().
        self.polls = 0
        self.source_errors = 0
        self.quarantine = Quarantine()
        self.stalls = CallStalls(stall_timeout)
        self.watch = KeyWatch(self._reader.offered.kv_watch, self._reader.duty)
        self.failed: BaseException | None = None
        self._failures = 0  # failed calls in a row
        # True while the thread waits for its next poll (read by the control loop at STOP).
        self.idle = False
        # Here, not in the loop's frame: a thread that ends at STOP frees nothing on its way out (1M keys: ~0.1 s).
        self.sent: Sent = {}
        # The last poll sent whole: wall-clock start, monotonic start, the sync token it answered.
        self._last_poll: tuple[float, float, int] | None = None
        # The highest SYNC token received (written by the control loop, then it wakes this thread), the
        # partitions SYNCs asked for (only grows, replaced whole), and those the source was told of.
        self.sync_received = 0
        self._partitions_wanted: frozenset[str] = frozenset()
        self._partitions_included: frozenset[str] = frozenset()
        self._screen_limits = limits or Limits(max_frame_bytes=max_frame_bytes)
        # A SYNC, RESYNC or STOP arrived since the last hold began (_hold): a pause between polls ends.
        self._poll_asked = False

    def figures(self) -> PollFigures:
        """What a heartbeat says: polls, errors, stalls, the quarantine, the listings and the watch."""
        quarantine, duty, watch = self.quarantine, self.duty, self.watch
        return PollFigures(self.polls, self.source_errors, self.stalls.count, self.stalls.running_for(),
                           len(quarantine.keys), quarantine.names(), duty.listings, duty.last_seconds,
                           duty.total_seconds, duty.measured_share(), watch.reads, watch.listings)

    def request_resync(self) -> None:
        """Send a full snapshot on the next poll, and poll now."""
        self._resync.set()
        self._poll_asked = True
        self._wake.set()

    @property
    def duty(self) -> ListingDuty:
        """The listing duty cycle: what the listings cost, and when the next may start."""
        return self._reader.duty

    def request_sync(self, token: int, partitions: Sequence[str] = (), mark: bool = False) -> None:
        """Poll now (a ``mark``: when due); the listing that begins next answers SYNC ``token`` (and every earlier
        one).

        That listing and every later one include ``partitions`` (a source that lists a chosen set of them).
        """
        if partitions and not self._partitions_wanted.issuperset(partitions):
            # Before the token: a listing that reads the token sees these too.
            self._partitions_wanted = self._partitions_wanted.union(partitions)
        # A token already received is asked again (lost on a reconnect): its poll is due already.
        if token > self.sync_received:
            self.sync_received = token
            if not mark:
                self._poll_asked = True
                self._wake.set()

    def request_watch(self, partition: str, keys: list[str], seconds: float, every: float) -> None:
        """Watch ``keys`` of ``partition`` for ``seconds`` from now (no keys or 0 s: stop; no ``kv_watch``: no-op); a
        change seen brings a listing forward, no sooner than ``every`` after the last one it brought forward."""
        if self.watch.request(partition, keys, seconds, every):
            self._wake.set()  # a pause reads the new keys at once; it ends only for a poll asked for

    def stop(self) -> None:
        self.stopping.set()
        self._poll_asked = True
        self._wake.set()

    def _pause(self, seconds: float, *, ends_on_request: bool = True) -> None:
        """Wait ``seconds`` (``idle``), reading the watched keys meanwhile.

        Ends sooner at STOP, once a change the watch saw may be listed, and if ``ends_on_request`` at a SYNC or RESYNC.
        """
        until = time.monotonic() + seconds
        self.idle = True
        while not self.stopping.is_set():
            now = time.monotonic()
            if (ends_on_request and self._poll_asked) or now >= until:
                break
            if self.watch.change_seen:
                wait = self.watch.wait_for_change(now)
                if wait <= 0:
                    break
                self._wake.wait(min(until - now, wait))
            else:
                due = self.watch.due(now)
                if due is not None and due[1] <= now:
                    self.watch.read(due[0], now, self.sent)
                    continue
                self._wake.wait((until if due is None else min(until, due[1])) - now)
            self._wake.clear()
        self.idle = False

    def _resends(self) -> bool:
        """Whether a snapshot now (a RESYNC) is ``sent`` again under the last poll, not a listing.

        It repairs the receiver at once, free for the store and outside the share (a change feed's reader answers).
        A buffer that needs a listing begun after a token (buffer.stream, a poller it lets list anew) refuses it
        and asks again: the listing answering its SYNC is then sent again, and taken.
        """
        return self._last_poll is not None and not self._reader.feed

    def _resend(self) -> float | None:
        """Send ``sent`` as a full snapshot of the last poll; the pause before the next listing (None: stopping)."""
        assert self._last_poll is not None
        started, began, covered = self._last_poll
        # Screened and packed when it was first sent: encoded as it is.
        held = Diff((), self.sent, full=True, limits=self._screen_limits, size=self.chunk_items, held=self.sent)
        if not self._send(held, {}, poll=self.polls, started=started, full=True, sync=covered):
            return None
        # Not a poll: the next listing is due when it was (a request that came meanwhile wakes it).
        return self.poll_interval - (time.monotonic() - began)

    def _send(self, pieces: Iterable[Piece], deletes: Mapping[str, list[str]], *, poll: int, started: float,
              full: bool, sync: int) -> bool:
        """Emit one poll as DELTA bodies, the first marked as a snapshot's start if ``full``; False once stopping."""
        first = full
        for body in iter_encode_delta(pieces, deletes, poll=poll, started=started, full=full,
                                      chunk_items=self.chunk_items, max_frame_bytes=self.max_frame_bytes, sync=sync):
            if not self._hand_over(Kind.DELTA, body, first, self.stopping):
                return False
            first = False
        return True

    def _hold(self, full: bool) -> bool | None:
        """Wait until the listing share allows this poll's read; return ``full`` as it then is (``None``: STOP).

        A SYNC or RESYNC meanwhile is served by the next read (a RESYNC makes it a snapshot); a watched change, sooner.
        """
        while True:
            full = self.claim_requests(full)
            if full and self._resends():
                wait = 0.0
            else:
                wait = self._reader.wait_for()
                if self.watch.change_seen:
                    wait = min(wait, self.watch.wait_for_change())
            if wait <= 0:
                return None if self.stopping.is_set() else full
            self._pause(wait, ends_on_request=False)
            if self.stopping.is_set():
                return None

    def claim_requests(self, full: bool) -> bool:
        """Every request seen from now on is answered by the coming read (a later one wakes the thread again);
        whether that read must be a full one (``full``, or a RESYNC came)."""
        self._wake.clear()
        self._poll_asked = False
        if self._resync.is_set():
            self._resync.clear()
            return True
        return full

    def run(self) -> None:
        try:
            self._poll_until_stopped()
        except BaseException as exc:  # noqa: BLE001 - reported below, never swallowed
            # A source raising SystemExit, or a bug here, must not end the thread unseen: the control
            # loop ends the poller with this fatal ERROR, and the buffer restarts it.
            self.failed = exc
            self.source_errors += 1
            logger.error("the polling thread died: %r", exc)
            self._hand_over(Kind.ERROR, _error_body(exc, fatal=True, count=1), False, self.stopping)

    def _poll_until_stopped(self) -> None:
        full = True
        if self.admitted is not None:
            # A standalone poller lists first once the buffer admitted it: the buffer's first-listing request (a
            # SYNC and a RESYNC, buffer.stream) comes before the ACK, so that listing answers it; at worst, it
            # lists anyway after ADMISSION_WAIT (the buffer then asks again).
            deadline = time.monotonic() + ADMISSION_WAIT
            while not self.admitted.is_set() and not self.stopping.is_set() and time.monotonic() < deadline:
                self.admitted.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        while not self.stopping.is_set():
            held = self._hold(full)
            if held is None:
                return
            step = self.poll(held)
            if step is None:
                return
            full, pause = step
            self._pause(pause)

    def poll(self, full: bool) -> tuple[bool, float] | None:
        """One poll, now: a listing (or a change read) diffed and handed over; or, for a snapshot of a source
        without a change feed, what the last poll sent, sent again (:meth:`_resends`).

        Returns whether the next poll must be a full one and the pause before it; ``None`` once the poller
        stops (handing over refused, or the source failed for good). The thread calls it when
        :meth:`_hold` allows; a simulation of the poller (tests/simulation) calls it directly.
        """
        if full and self._resends():
            pause = self._resend()
            return None if pause is None else (False, pause)
        sent = self.sent
        started = time.time()
        began = time.monotonic()
        self.watch.listing_began(began)
        covered = self.sync_received  # before the listing: it answers only requests received by now
        wanted = self._partitions_wanted  # read after the token (see request_sync)
        call = self.stalls.next_call()
        diff: Diff | None = None
        try:
            if wanted != self._partitions_included:
                self._reader.include(wanted)
                self._partitions_included = wanted
            self.stalls.begin(call, began)
            try:
                diff = self._reader.read(sent, full, limits=self._screen_limits, size=self.chunk_items)
            finally:
                self.stalls.end()
            self.stalls.answered()
            # A piece at a time, each sent before the next is made: a snapshot is applied while it is packed.
            if not self._send(diff, diff.deletes, poll=self.polls + 1, started=started, full=diff.full, sync=covered):
                return None
        except SourceStall as exc:
            self.stalls.stalled(call, str(exc) or type(exc).__name__)
            # Asked again one poll interval after the call gave up (a SYNC wakes it sooner).
            return full, self.poll_interval
        except Exception as exc:  # any source failure is reported, never fatal to the trainer
            self.stalls.answered()  # an error is an answer: it ends a stall episode
            self._failures += 1
            failures = self._failures
            self.source_errors += 1
            fatal = failures >= MAX_FAILURES
            logger.debug("kv_list() failed (%d in a row): %r", failures, exc)
            if fatal:
                self.failed = exc
            body = _error_body(exc, fatal=fatal, count=failures, limits=self.limits)
            if not self._hand_over(Kind.ERROR, body, False, self.stopping) or fatal:
                return None
            return full, min(BACKOFF_BASE * 2 ** (failures - 1), BACKOFF_CAP)
        finally:
            if diff is not None:
                # A store read in pieces holds a read transaction: a poll cut short must not keep it.
                diff.close()
        self._failures = 0
        assert diff is not None
        diff.commit(sent)
        if diff.complete:
            self.quarantine.replace(diff.refused)
        else:
            self.quarantine.update(diff.refused, diff.packed, diff.gone)
        self._reader.commit()
        # Not kept until the next poll: after a snapshot of a million keys it holds every key sent.
        del diff
        self.polls += 1
        self._last_poll = (started, began, covered)
        # Start to start (a change waits poll_interval/2 on average); a slow poll still leaves a tenth of it.
        elapsed = time.monotonic() - began
        return False, max(self.poll_interval - elapsed, self.poll_interval * 0.1)
