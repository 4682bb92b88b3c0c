"""The receiver: one thread that owns the buffer's ROUTER socket.

It moves frames between the socket and the peer state machine (:class:`~buffer.peers.PeerTable`) and
sends the messages that returns. Other threads reach it only through a command queue and a wake-up pipe,
so only the thread that created the socket uses it.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from typing import Callable

import zmq

from buffer.access import EndpointInUseError, Gatekeeper, claim_ipc_path, restrict_ipc_socket
from buffer.partitions import PartitionStore
from buffer.peers import Peer, PeerTable, Send
from poller.wire.curve import CurveServer
from poller.wire.protocol import DEFAULT_LIMITS, Limits, encode_body, encode_header
from poller.wire.wakeup import WakePipe

__all__ = ["StreamReceiver"]

logger = logging.getLogger(__name__)

class StreamReceiver:
    """Binds ``endpoint`` and applies what pollers send to ``store``; ``curve`` admits only its allowed keys,
    ``pinned`` names peers never forgotten to make room for others (the buffer's own poller)."""

    def __init__(self, store: PartitionStore, endpoint: str, *, limits: Limits = DEFAULT_LIMITS,
                 curve: CurveServer | None = None, stale_after: float = 5.0,
                 pinned: frozenset[str] = frozenset()) -> None:
        self._requested_endpoint = endpoint
        self.limits = limits
        self.curve = curve
        self.stale_after = stale_after
        self._gate: Gatekeeper | None = None
        self.endpoint: str | None = None
        # What other threads ask the thread to send: each call makes the messages, in the thread.
        self._commands: "queue.SimpleQueue[Callable[[], list[Send]]]" = queue.SimpleQueue()
        self._quit = False
        self._wake = WakePipe()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="replay-receiver", daemon=True)
        self._events = threading.Condition()
        #: The peer state machine; read its counters from any thread.
        self.table = PeerTable(store, limits=limits, stale_after=stale_after,
                               pinned=frozenset(name.encode() for name in pinned), on_change=self._notify)
        self._stopped = False
        # Set by stop_after_bye(): (identity, epoch) whose BYE ends the thread, and what to run then.
        self._last_bye: tuple[bytes, int | None] | None = None
        self._after_bye: Callable[[], None] | None = None
        self._ended_on_bye = False

    def start(self, timeout: float = 10.0) -> str:
        """Start the thread and bind; return the bound endpoint."""
        self._thread.start()
        if not self._bound.wait(timeout):
            raise RuntimeError(f"the receiver did not bind {self._requested_endpoint} within {timeout}s")
        if self._bind_error is not None:
            self._thread.join(timeout)
            raise self._bind_error
        assert self.endpoint is not None
        return self.endpoint

    def _command(self, make: Callable[[], list[Send]]) -> None:
        self._commands.put(make)
        self._wake.poke()

    def _notify(self) -> None:
        with self._events:
            self._events.notify_all()

    def send_sync(self, peer: str, token: int) -> None:
        """Queue a SYNC ``token`` for ``peer``: it polls at once and tags that listing with the token."""
        identity = peer.encode()
        self._command(lambda: [self.table.sync(identity, token, time.monotonic())])

    def send_watch(self, peer: str, partition: str, keys: list[str], seconds: float) -> None:
        """Queue a WATCH for ``peer``: read ``keys`` for ``seconds`` and list as soon as one changed (no keys: stop)."""
        identity = peer.encode()
        self._command(lambda: [self.table.watch(identity, partition, keys, seconds)])

    def expect(self, peer: str, epoch: int) -> None:
        """From now on only ``epoch`` may speak as ``peer`` (called before that process starts). Not through the
        command queue: the table's two dicts are updated in single GIL-atomic steps."""
        self.table.expect(peer.encode(), epoch)

    def stop_after_bye(self, peer: str, epoch: int | None, then: Callable[[], None] | None = None) -> None:
        """Let the thread end by itself once ``peer``'s BYE of ``epoch`` is applied, then run ``then()``: closing
        the socket (and ``then()``) overlaps the poller's exit instead of following it."""
        self._after_bye = then
        # Read by the thread after every message and wake-up; only a BYE already applied needs a wake-up
        # (waking it for nothing costs the close ladder a GIL hand-off before its STOP).
        self._last_bye = awaited = (peer.encode(), epoch)
        if self._bye_applied(*awaited):
            self._wake.poke()

    def wait_bye(self, peer: str, epoch: int | None, timeout: float) -> bool:
        """Wait until ``peer``'s BYE of ``epoch`` was applied; True if no gap came before it."""
        state = self._wait_for(peer, lambda p: p.epoch == epoch and p.bye_seq is not None, timeout)
        return state is not None and state.contiguous

    def wait_first_poll(self, peer: str, timeout: float) -> bool:
        """Wait until ``peer`` has had one complete poll applied."""
        return self._wait_for(peer, lambda p: p.polls_applied > 0, timeout) is not None

    def _wait_for(self, peer: str, predicate: Callable[[Peer], bool], timeout: float) -> Peer | None:
        deadline = time.monotonic() + timeout
        identity = peer.encode()
        with self._events:
            while True:
                state = self.table.peers.get(identity)
                if state is not None and predicate(state):
                    return state
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return None
                self._events.wait(remaining)

    def peer_info(self, peer: str) -> Peer | None:
        return self.table.peers.get(peer.encode())

    @property
    def auth_rejected(self) -> int:
        """Handshakes refused for want of an allowed CURVE key."""
        return self._gate.rejected if self._gate is not None else 0

    def streaming(self) -> list[str]:
        """The pollers streaming now: connected, not silent past ``stale_after``, no BYE said."""
        return [peer.stream for peer in list(self.table.peers.values())
                if peer.bye_seq is None and not peer.stale and peer.epoch is not None]

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, close the socket, release the pipe. Idempotent."""
        if self._stopped:
            return
        if self._thread.is_alive():
            self._quit = True
            self._wake.poke()
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("receiver thread did not stop within %ss", timeout)
                return
        # Only now: a stop() interrupted while joining (Ctrl-C) must be redone by the next one.
        self._stopped = True
        self._wake.close()

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        gate: Gatekeeper | None = None
        try:
            gate = self._gate = Gatekeeper(ctx, self.curve)
            sock.setsockopt(zmq.LINGER, 0)
            # No ROUTER_HANDOVER: with it, a second connection using a name cut the first off for good.
            # Without it the second is refused while the first lives; the heartbeats below free the name
            # of a peer that vanished, and a poller refused on reconnecting dials again (poller.link).
            sock.setsockopt(zmq.RCVHWM, 10000)
            # libzmq drops a sender of a bigger frame before buffering it; decode() checks again.
            sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
            # ZMTP heartbeats drop connections whose far end vanished without a FIN (a cut link, a dead host).
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(3000, int(self.stale_after * 1000)))
            gate.arm(sock)
            claim_ipc_path(self._requested_endpoint)
            try:
                sock.bind(self._requested_endpoint)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                # The same meaning as a held ipc path, for every transport.
                raise EndpointInUseError(f"cannot bind {self._requested_endpoint}: the address is in use "
                                         f"(another buffer or program listens there)") from exc
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            restrict_ipc_socket(self.endpoint)
        except BaseException as exc:
            self._bind_error = exc
            self._close_socket(ctx, sock, gate)
            self._bound.set()
            return
        self._bound.set()
        try:
            self._loop(sock)
        except BaseException:
            logger.exception("receiver thread failed")
        finally:
            self._close_socket(ctx, sock, gate)
            # After the socket's close: removing its file first made the close ~1 ms slower.
            if self._ended_on_bye and self._after_bye is not None:
                try:
                    self._after_bye()
                except Exception:  # the owner's close() does it again and reports what fails there
                    logger.exception("the clean-up after the poller's BYE failed")
            self._notify()

    @staticmethod
    def _close_socket(ctx: zmq.Context, sock: zmq.Socket, gate: Gatekeeper | None) -> None:
        if gate is not None:
            gate.close(sock)  # the socket before the authenticator
        else:
            sock.close(0)
        ctx.term()

    def _loop(self, sock: zmq.Socket) -> None:
        assert self._gate is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake.read_fd, zmq.POLLIN)
        monitor = self._gate.monitor
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        # How often silence is checked: bounds how late the stale warning comes.
        tick_ms = int(min(1.0, self.stale_after / 4) * 1000) or 1
        table = self.table
        while True:
            events = dict(poller.poll(tick_ms))
            if self._wake.read_fd in events:
                self._wake.drain()
            if monitor is not None and monitor in events:
                self._gate.on_monitor()
            self._send_all(sock, table.tick(time.monotonic()))
            while not self._commands.empty():
                self._send_all(sock, self._commands.get_nowait()())
            if self._ends_on_bye() or self._quit:
                return
            if sock in events:
                for _ in range(1000):  # bounded, so commands are never starved
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    identity = frames[0].bytes
                    self._send_all(sock, table.on_frames(identity, [f.buffer for f in frames[1:]],
                                                         time.monotonic()))
                    if self._ends_on_bye():
                        return

    def _ends_on_bye(self) -> bool:
        """Whether the BYE :meth:`stop_after_bye` awaits was applied (the thread then ends)."""
        self._ended_on_bye = self._last_bye is not None and self._bye_applied(*self._last_bye)
        return self._ended_on_bye

    def _bye_applied(self, identity: bytes, epoch: int | None) -> bool:
        peer = self.table.peers.get(identity)
        return peer is not None and peer.epoch == epoch and peer.bye_seq is not None

    @staticmethod
    def _send_all(sock: zmq.Socket, actions: list[Send]) -> None:
        for action in actions:
            try:
                sock.send_multipart([action.identity, encode_header(action.kind, action.epoch, 0),
                                     encode_body(action.kind, action.body)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.debug("could not send %s to %r: %s", action.kind.name, action.identity, exc)
