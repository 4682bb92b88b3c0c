"""The poller's one outgoing path: the :class:`Outbox` takes the polling thread's bodies straight (a bounded queue)
and stamps every message with the epoch and the next sequence number in one place (so BYE names the last one sent),
and the :class:`Link`, the DEALER socket, carries them, on the control loop's thread (:mod:`poller.worker`).

ZeroMQ reconnects by itself, and that is the danger: a connection dropped while the buffer was stopped (SIGSTOP,
a GC pause; the ZMTP heartbeat gives up after 3 s) takes what was queued on it along, and the buffer's ROUTER
refuses the new connection while it holds the old one under the same name. So every new connection after the
first asks for a full snapshot, and one that no ACK answers within :data:`ACK_TIMEOUT` is dialled again.
"""

from __future__ import annotations

import collections
import logging
import queue
import struct
import threading
import time
from typing import TYPE_CHECKING, Deque

import zmq

from poller.common.wakeup import WakePipe
from poller.wire.protocol import Kind, Limits, Log, encode_body, encode_header, fit_text

if TYPE_CHECKING:
    from poller.wire.curve import CurveClient

__all__ = ["Link", "Outbox", "ACK_TIMEOUT"]

logger = logging.getLogger(__name__)

#: How long a new connection may go without an ACK before it is dialled again (three heartbeats).
ACK_TIMEOUT = 3.0

# The server refused our key (ZAP), or the handshake broke (e.g. we hold the wrong server key).
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
# A monitor event's first frame: uint16 event, uint32 value (zmq.utils.monitor imports asyncio, ~55 ms).
_EVENT_FRAME = struct.Struct("=HI")


class Outbox(logging.Handler):
    """The messages of one stream (``epoch``), stamped in order and held until the socket takes them.

    The polling thread hands bodies over (:meth:`emit_from_thread`, a bounded queue) and any
    thread that logs records (:meth:`emit`, sent as LOG); both poke ``wake``.
    """

    # The most stamped messages held for the socket; beyond it the source thread blocks (back-pressure).
    LIMIT = 16

    def __init__(self, epoch: int, wake: WakePipe, *, limits: Limits | None, log_level: int) -> None:
        super().__init__(log_level)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.epoch = epoch
        self.seq = -1
        # The seq of the first body of the latest full snapshot sent (-1: none yet).
        self.snapshot_seq = -1
        # Stamped messages (head and body frames) the socket has not taken yet.
        self.pending: Deque[list[bytes]] = collections.deque()
        # Bodies the polling thread handed over, and log records, not yet stamped.
        self.items: "queue.Queue[tuple[Kind, bytes, bool]]" = queue.Queue(maxsize=64)
        self.records: Deque[tuple[int, str, str]] = collections.deque(maxlen=1000)
        self._wake = wake
        self._limits = limits

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append((record.levelno, record.name, self.format(record)))
            self._wake.poke()
        except Exception:  # a log call must never break the poller
            self.handleError(record)

    def queue_message(self, kind: Kind, body: bytes) -> None:
        self.seq += 1
        self.pending.append([encode_header(kind, self.epoch, self.seq), body])

    def emit_from_thread(self, kind: Kind, body: bytes, starts_snapshot: bool, stopping: threading.Event) -> bool:
        """Called by the source thread; blocks while the outbox is full, until ``stopping`` is set."""
        while not stopping.is_set():
            try:
                self.items.put((kind, body, starts_snapshot), timeout=0.1)
            except queue.Full:
                continue
            self._wake.poke()
            return True
        return False

    def pull_items(self) -> bool:
        """Stamp what the polling thread and the log handler handed over; True if there was any."""
        before = len(self.pending)
        while len(self.pending) < self.LIMIT:
            try:
                kind, body, starts_snapshot = self.items.get_nowait()
            except queue.Empty:
                break
            self.queue_message(kind, body)
            if starts_snapshot:
                self.snapshot_seq = self.seq
        while self.records:
            level, name, text = self.records.popleft()
            log = Log(level, fit_text(name, self._limits), fit_text(text, self._limits))
            self.queue_message(Kind.LOG, encode_body(Kind.LOG, log))
        return len(self.pending) > before

    def send_pending(self, sock: zmq.Socket) -> None:
        """Send what the socket takes now, in order, without blocking."""
        while self.pending:
            try:
                # Copied: zero-copy frames would start a second pyzmq context and thread, torn down at exit.
                sock.send_multipart(self.pending[0], flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self.pending.popleft()


class Link:
    """A connected DEALER named ``name``, watched for lost and refused connections."""

    def __init__(self, ctx: zmq.Context, *, name: str, endpoint: str, linger: float,
                 curve: CurveClient | None = None) -> None:
        self.name = name
        self.endpoint = endpoint
        self.connections = 0
        self.handshake_failures = 0
        self._acks_seen = False
        self._probe_deadline: float | None = None
        self.sock = ctx.socket(zmq.DEALER)
        try:
            self.sock.setsockopt(zmq.IDENTITY, name.encode())
            self.sock.setsockopt(zmq.LINGER, int(linger * 1000))
            self.sock.setsockopt(zmq.SNDHWM, 1000)
            if curve is not None:
                curve.apply(self.sock)
            # A connection whose far end vanished is dropped after 3 s of silence, not when TCP gives up.
            self.sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
            self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            self.monitor = self.sock.get_monitor_socket(_EVENTS)
        except BaseException:
            self.sock.close(0)
            raise
        try:
            self.sock.connect(endpoint)
        except BaseException:  # a malformed endpoint
            self.close()
            raise

    def on_events(self) -> bool:
        """Read the monitor; True when a new connection replaced a lost one (resync)."""
        replaced = False
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return replaced
            event, _ = _EVENT_FRAME.unpack(frames[0][:_EVENT_FRAME.size])
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connections += 1
                if self.connections > 1:
                    logger.info("poller %s: connected again (connection %d); asking for a full snapshot",
                                self.name, self.connections)
                    replaced = True
                    # Probe the new connection: the heartbeat the owner sends now must be answered.
                    self._probe_deadline = time.monotonic() + ACK_TIMEOUT if self._acks_seen else None
            elif event == zmq.EVENT_DISCONNECTED:
                logger.debug("poller %s: connection lost", self.name)
            elif event & _HANDSHAKE_FAILED:
                self.handshake_failures += 1
                if self.handshake_failures <= 3 or self.handshake_failures % 100 == 0:
                    logger.warning("poller %s: the buffer refused the CURVE handshake (%d times so far; event %s): "
                                   "is this poller's public key allowed, and is --curve-server-key the buffer's?",
                                   self.name, self.handshake_failures, event)

    def on_ack(self) -> None:
        """The buffer answered a heartbeat: this connection is admitted."""
        self._acks_seen = True
        self._probe_deadline = None

    def check(self) -> None:
        """Dial again if a new connection went unanswered."""
        if self._probe_deadline is None or time.monotonic() < self._probe_deadline:
            return
        logger.warning("poller %s: no answer from the buffer %.0fs after reconnecting (it may still hold the old "
                       "connection); dialling again", self.name, ACK_TIMEOUT)
        self._probe_deadline = None
        try:
            self.sock.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass  # already gone
        self.sock.connect(self.endpoint)

    def close(self) -> None:
        """Close the monitor, then the socket (its linger bounds the context's term)."""
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.sock.close()
