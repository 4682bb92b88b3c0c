"""The poller's connection to the buffer: one DEALER socket and its recovery.

ZeroMQ reconnects by itself, and that is the danger: a connection dropped
while the buffer was stopped (SIGSTOP, a GC pause, a debugger; the ZMTP
heartbeat gives up after 3 s) takes what was queued on it along, and the
buffer's ROUTER refuses the new connection while it still holds the old one
under the same name: the poller would stream into nothing, for good. So:

- every new connection after the first may have lost messages:
  :meth:`Link.on_events` returns True, and the owner asks for a full snapshot
  and heartbeats at once;
- the buffer answers heartbeats with ACK; a new connection without an ACK
  within :data:`ACK_TIMEOUT` was not admitted, and :meth:`Link.check` dials
  again until one is.

Owned by the control loop's thread, which created the socket.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:
    from poller.wire.curve import CurveClient

__all__ = ["Link", "ACK_TIMEOUT"]

logger = logging.getLogger(__name__)

#: How long a new connection may go without an ACK before it is dialled again (three heartbeats).
ACK_TIMEOUT = 3.0

# The server refused our key (ZAP), or the handshake broke (e.g. we hold the wrong server key).
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
# A monitor event's first frame: uint16 event, uint32 value, native order. Not parsed
# with zmq.utils.monitor, which imports asyncio (~55 ms of every poller's start-up).
_EVENT_FRAME = struct.Struct("=HI")


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
            # A connection whose far end vanished (link down, host gone) is dropped after 3 s
            # of silence and dialled again, not minutes later when TCP gives up.
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
