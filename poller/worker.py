"""The poller process's control loop.

::

    kv_list() ──▶ PollingThread ──Outbox──▶ control loop ──DEALER──▶ buffer
                  (may block forever)       │   ▲
                                            │   └── STOP / RESYNC / SYNC (zmq), stop / EOF (lifeline),
                                            │       SIGTERM (wakeup fd), parent pid check
                                            └── READY, HEARTBEAT, LOG, BYE; seq numbers

The control loop never calls the source, so STOP, SIGTERM and parent death are answered
within milliseconds even while ``kv_list()`` is stuck. It owns the only socket.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable

import zmq

from poller.common import lifeline
from poller.common.checks import check_worker_config
from poller.common.config import ExitCode, WorkerConfig
from poller.common.lifeline import Started, StartFailed, StopRequest
from poller.common.procfs import own_rss_bytes
from poller.common.wakeup import WakePipe
from poller.link import Link, Outbox
from poller.polling import MAX_FAILURES, PollingThread
from poller.sources.contract import describe_spec, load_source
from poller.wire.errors import PollerCrashed, PollerStartupError, ProtocolError
from poller.wire.protocol import Bye, Heartbeat, Kind, Ready, Resync, decode, encode_body

__all__ = ["resync_answered", "run_embedded", "run_standalone"]

logger = logging.getLogger(__name__)

# Before os._exit, the most to wait for a woken polling thread to end (<1 ms; alive, it delays the exit).
_THREAD_END_S = 0.05
#: Seconds between two heartbeats (the buffer's stale_after is a few of them).
HEARTBEAT_INTERVAL = 1.0
#: How often the idle control loop wakes: bounds how late it notices a dead parent that left no EOF.
TICK = 0.2
#: The most BYE and what precedes it may wait for the socket at the end.
LINGER = 1.0


def run_embedded(config: WorkerConfig, lifeline_conn: lifeline.Channel, *,
                 before_exit: Callable[[], None] | None = None) -> None:
    """Run a poller spawned by :class:`~poller.PollerProcess`; ends with ``os._exit`` (``kv_list()`` may be stuck).

    ``before_exit`` runs last, right before ``os._exit`` (:mod:`poller.child` ends its watchdog there).
    """
    code = ExitCode.CRASHED
    try:
        code = _ControlLoop(config, lifeline_conn).run()
    except BaseException as exc:
        # A bug in the loop itself: its traceback goes to the parent (PollerCrashed's cause).
        lifeline.send(lifeline_conn, lifeline.failure(exc))
    finally:
        logging.shutdown()
        try:
            if before_exit is not None:
                before_exit()
        finally:
            os._exit(code)


def run_standalone(config: WorkerConfig) -> int:
    """Run a poller in this process until STOP, SIGTERM or SIGINT; return its exit code.

    Raises:
        PollerStartupError: the source could not be built or the endpoint not connected (``__cause__``).
        PollerCrashed: ``kv_list()`` failed :data:`~poller.polling.MAX_FAILURES` times in a row (the last one is
            the ``__cause__``).
        ValueError: a numeric field of ``config`` is out of range (e.g. ``poll_interval=inf``).
    """
    check_worker_config(config)
    loop = _ControlLoop(config, None)
    code = loop.run()
    if (exc := loop.startup_error) is not None:
        raise PollerStartupError(f"cannot start poller for {describe_spec(config.source)}: "
                                 f"{type(exc).__name__}: {exc}") from exc
    failed = loop.thread.failed if loop.thread is not None else None
    if code == ExitCode.SOURCE_FAILED and failed is not None:
        raise PollerCrashed(f"kv_list() of {describe_spec(config.source)} failed {MAX_FAILURES} times in "
                            f"a row, last with {type(failed).__name__}: {failed}") from failed
    return code


def resync_answered(resync: Resync, stamped: int, epoch: int, snapshot_seq: int) -> bool:
    """Whether a RESYNC stamped with epoch ``stamped`` is answered already by the snapshot this process (``epoch``)
    began sending at ``snapshot_seq``: it began after the last message the buffer received (at 1M keys a second
    snapshot costs seconds)."""
    return resync.after >= 0 and stamped == epoch and snapshot_seq > resync.after


class _ControlLoop:
    """One run of the poller: start, stream, stop. Not reusable."""

    def __init__(self, config: WorkerConfig, lifeline_conn: lifeline.Channel | None) -> None:
        self.config = config
        self.lifeline = lifeline_conn
        self.embedded = lifeline_conn is not None
        # A spawning buffer chose the epoch itself. os.urandom: secrets costs start-up time.
        self.epoch = config.epoch or (int.from_bytes(os.urandom(8), "big") >> 2) + 1
        self.stop_reason: str | None = None
        self.exit_code = ExitCode.OK
        self.parent_pid = os.getppid()
        # Poked by the polling thread, by any thread that logs, and by signals (set_wakeup_fd).
        self.wake = WakePipe()
        self.outbox = Outbox(self.epoch, self.wake, limits=config.limits, log_level=config.log_level)
        self.thread: PollingThread | None = None
        self.thread_woken = False  # told to stop while it waited for its next poll
        self.startup_error: BaseException | None = None
        self.stalls_reported = 0
        self.quarantine_reported = 0  # Quarantine.changes last reported
        self.heartbeat_now = True  # at start, and on a new connection

    def _install_signals(self) -> tuple[Any, Any, int] | None:
        """Take over SIGTERM, SIGINT and the wakeup fd; return what they were (None: not the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return None  # signal handlers can only be set from the main thread
        # Ctrl-C reaches the whole process group: an embedded poller leaves it to the trainer.
        on_interrupt = signal.SIG_IGN if self.embedded else self._on_signal
        return (signal.signal(signal.SIGTERM, self._on_signal), signal.signal(signal.SIGINT, on_interrupt),
                signal.set_wakeup_fd(self.wake.write_fd, warn_on_full_buffer=False))

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_reason is None:
            self.stop_reason = signal.Signals(signum).name

    def _heartbeat(self, thread: PollingThread) -> None:
        self.quarantine_reported = thread.quarantine.changes
        figures = thread.figures()
        self.stalls_reported = figures.source_stalls
        # last_seq also asks the buffer for an ACK, which proves a new connection admitted (poller.link).
        self.outbox.queue_message(Kind.HEARTBEAT, encode_body(Kind.HEARTBEAT, Heartbeat(
            rss=own_rss_bytes(), last_seq=self.outbox.seq, **figures._asdict())))

    def _on_control(self, link: Link, thread: PollingThread) -> None:
        while True:
            try:
                frames = link.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode(frames)
            except ProtocolError as exc:
                logger.warning("poller %s ignored a malformed control message: %s", self.config.name, exc)
                continue
            body = message.body
            if message.kind is Kind.ACK:
                link.on_ack()
                if thread.admitted is not None:
                    thread.admitted.set()
            elif message.kind is Kind.STOP:
                self.stop_reason = self.stop_reason or f"STOP: {body.reason}"
            elif message.kind is Kind.RESYNC:
                if resync_answered(body, message.epoch, self.epoch, self.outbox.snapshot_seq):
                    logger.debug("resync requested (%s) after seq %s: the snapshot from seq %d answers it",
                                 body.reason, body.after, self.outbox.snapshot_seq)
                else:
                    logger.debug("resync requested: %s", body.reason)
                    thread.request_resync()
            elif message.kind is Kind.SYNC:
                thread.request_sync(body.token, body.partitions, body.mark)
            elif message.kind is Kind.WATCH:
                thread.request_watch(body.partition, body.keys, body.seconds, body.every)
            else:
                logger.warning("poller %s ignored an unexpected %s message", self.config.name, message.kind.name)

    def _orphaned(self, why: str) -> None:
        # Nobody is listening any more: no BYE, no linger, just go.
        self.stop_reason = f"parent gone ({why})"
        self.exit_code = ExitCode.ORPHANED

    def run(self) -> int:
        # Signals are taken over once the source is built: until then SIGTERM ends a stuck factory at once.
        previous_signals = None
        root = logging.getLogger()
        root.addHandler(self.outbox)
        if self.embedded:  # its own process: the root level decides which records exist at all
            root.setLevel(self.config.log_level)
        ctx: zmq.Context | None = None
        link: Link | None = None
        try:
            try:
                source = load_source(self.config.source, self.config.source_kwargs)
                ctx = zmq.Context()
                link = Link(ctx, name=self.config.name, endpoint=self.config.endpoint,
                            linger=LINGER, curve=self.config.curve)
            except BaseException as exc:
                if self.lifeline is not None:
                    # A store that cannot be reached now is worth retrying; a broken source is not.
                    lifeline.send(self.lifeline, lifeline.failure(
                        exc, StartFailed, unavailable=isinstance(exc, (ConnectionError, TimeoutError))))
                # Reported to the caller (lifeline or run_standalone), so not logged twice.
                logger.debug("poller failed to start: %r", exc)
                self.startup_error = exc
                self.exit_code = ExitCode.STARTUP_FAILED
                return self.exit_code
            previous_signals = self._install_signals()
            self.outbox.queue_message(Kind.READY, encode_body(Kind.READY, Ready(os.getpid(), self.config.name,
                                                                                self.config.poll_interval)))
            self.thread = PollingThread(
                source, self.outbox.emit_from_thread, poll_interval=self.config.poll_interval,
                chunk_items=self.config.chunk_items,
                max_frame_bytes=self.config.max_frame_bytes, stall_timeout=self.config.stall_timeout,
                limits=self.config.limits, listing_share=self.config.listing_share,
                # The buffer asks a standalone poller for a first listing of its own (buffer.stream): wait for it.
                admitted=None if self.embedded else threading.Event())
            self.thread.start()
            if self.lifeline is not None:
                lifeline.send(self.lifeline, Started(self.epoch, os.getpid()))
            self._loop(link, self.thread)
            self._finish(link.sock, self.thread)
            return self.exit_code
        finally:
            if self.thread is not None:
                self._stop_thread(self.thread)
            if link is not None:
                link.close()
            if ctx is not None:
                # Bounded by the socket's linger; the source thread holds no socket.
                ctx.term()
            if self.embedded:  # os._exit follows: handlers and the pipe go with the process
                thread = self.thread
                # A woken thread ends now, so os._exit ends a process of one thread; one in kv_list() cannot.
                if thread is not None and self.thread_woken and thread.stalls.call_started is None:
                    thread.join(_THREAD_END_S)
            else:
                root.removeHandler(self.outbox)
                if previous_signals is not None:
                    sigterm, sigint, wakeup_fd = previous_signals
                    signal.signal(signal.SIGTERM, sigterm)
                    signal.signal(signal.SIGINT, sigint)
                    signal.set_wakeup_fd(wakeup_fd)
                self.wake.close()
            if self.exit_code == ExitCode.ORPHANED and self.config.orphan_cleanup:
                import shutil  # rare path; kept out of start-up

                shutil.rmtree(self.config.orphan_cleanup, ignore_errors=True)

    def _loop(self, link: Link, thread: PollingThread) -> None:
        sock = link.sock
        poller = zmq.Poller()
        lifeline_fd = self.lifeline.fileno() if self.lifeline is not None else None
        for watched in (sock, self.wake.read_fd, link.monitor, lifeline_fd):
            if watched is not None:
                poller.register(watched, zmq.POLLIN)
        next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL
        outbox = self.outbox
        while self.stop_reason is None:
            outbox.pull_items()
            outbox.send_pending(sock)
            poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if outbox.pending else 0))
            wait = min(TICK, max(0.0, next_heartbeat - time.monotonic()))
            events = dict(poller.poll(int(wait * 1000)))
            if self.wake.read_fd in events:
                self.wake.drain()
            if self.lifeline is not None and lifeline_fd in events:
                try:
                    if isinstance(lifeline.recv(self.lifeline), StopRequest):
                        self.stop_reason = self.stop_reason or "STOP"
                except (EOFError, ValueError):
                    self._orphaned("the lifeline pipe closed")
            if events.get(sock, 0) & zmq.POLLIN:
                self._on_control(link, thread)
            if link.monitor in events and link.on_events():
                # What was queued on the lost connection is gone: a full snapshot.
                thread.request_resync()
                self.heartbeat_now = True
            link.check()
            if self.embedded and os.getppid() != self.parent_pid:
                self._orphaned("parent pid changed")
            if not thread.is_alive() and thread.failed is not None and outbox.items.empty():
                outbox.pull_items()  # the fatal ERROR itself
                self.stop_reason = "source failed"
                self.exit_code = ExitCode.SOURCE_FAILED
            thread.stalls.check()
            # A new stall or quarantine is reported at once, not at the next heartbeat.
            if (self.heartbeat_now or time.monotonic() >= next_heartbeat
                    or thread.stalls.count != self.stalls_reported
                    or thread.quarantine.changes != self.quarantine_reported):
                self.heartbeat_now = False
                self._heartbeat(thread)
                next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL

    def _stop_thread(self, thread: PollingThread) -> None:
        if self.embedded:
            # Not woken yet: it would compete for the GIL with BYE going out (see _finish).
            thread.stopping.set()
        else:
            thread.stop()

    def _finish(self, sock: zmq.Socket, thread: PollingThread) -> None:
        """Send what is queued, then BYE, within the linger bound."""
        idle = thread.idle  # before it is told to stop: waiting for its next poll
        self._stop_thread(thread)
        if self.exit_code == ExitCode.ORPHANED:
            sock.setsockopt(zmq.LINGER, 0)
        else:
            if thread.failed is not None and self.lifeline is not None:
                lifeline.send(self.lifeline, lifeline.failure(thread.failed))
            outbox = self.outbox
            while outbox.pull_items():  # take everything the thread already handed over
                outbox.send_pending(sock)
            outbox.queue_message(Kind.BYE, encode_body(Kind.BYE, Bye(outbox.seq, self.stop_reason or "")))
            deadline = time.monotonic() + LINGER
            while outbox.pending and time.monotonic() < deadline:
                outbox.send_pending(sock)
                if outbox.pending:
                    sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000) or 1, zmq.POLLOUT)
            logger.debug("poller %s stopping: %s (exit %d)", self.config.name, self.stop_reason, self.exit_code)
        if self.embedded and idle:
            # Wake a thread waiting for its next poll (it ends while the context terminates); one mid-poll
            # is left alone: it would only compete with the exit for a core.
            thread.stop()
            self.thread_woken = True
