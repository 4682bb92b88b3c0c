"""The poller's outgoing messages: taken in from every thread, stamped, held for the one socket.

The polling thread hands over encoded bodies through a bounded queue, and the
:class:`Outbox`, a log handler, takes records from any thread to send as LOG.
The control loop (:mod:`poller.worker`) stamps them with the epoch and the next
sequence number in one place, so BYE can name exactly the last message sent.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Deque

import zmq

from poller.wire.messages import Log
from poller.wire.protocol import Kind, Limits, encode_body, encode_header, fit_text
from poller.wire.wakeup import WakePipe

__all__ = ["Outbox"]


class Outbox(logging.Handler):
    """The messages of one stream (``epoch``), stamped in order and held until the socket takes them.

    Used from the control loop's thread, except :meth:`emit_from_thread` (the
    polling thread) and, as a log handler, :meth:`emit` (any thread that logs);
    both poke ``wake``.
    """

    # The most messages held for a socket that cannot take them yet; beyond
    # this the source thread blocks: the back-pressure we want.
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

    def pull_items(self) -> None:
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

    def send_pending(self, sock: zmq.Socket) -> None:
        """Send what the socket takes now, in order, without blocking."""
        while self.pending:
            try:
                # Copied: zero-copy frames are freed by a second pyzmq context and
                # thread, started on the first large body and torn down at every
                # exit; copying a snapshot body (~300 kB) costs ~50 us.
                sock.send_multipart(self.pending[0], flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self.pending.popleft()
