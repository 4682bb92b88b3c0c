"""The receiver: one thread that owns the buffer's ROUTER socket.

It decodes every message (strictly: a bad frame is counted and logged, never
fatal), checks each peer's epoch and sequence, applies deltas to the
:class:`~buffer.partitions.PartitionStore`, and asks a peer for a RESYNC when it sees
a gap. Other threads talk to it only through a command queue and a wake-up
pipe, so the socket is used by the thread that created it alone.

Hostile input is bounded: decoding by :class:`~poller.protocol.Limits`, the
per-peer state by ``Limits.max_peers``, and with CURVE a peer without an
allowed key never gets a frame to the decoder (:mod:`buffer.access`). A peer
that sends nothing for ``stale_after`` seconds (heartbeats come every second)
is reported stale and a warning is logged.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from poller.curve import CurveServer
from poller.errors import ProtocolError
from poller.protocol import DEFAULT_LIMITS, Kind, Limits, decode, encode_body, encode_header
from poller.wakeup import WakePipe

from .access import Gatekeeper, restrict_ipc_socket
from .partitions import PartitionStore

__all__ = ["StreamReceiver"]

logger = logging.getLogger(__name__)

# How long a RESYNC may stay unanswered before it is asked for again.
_RESYNC_RETRY_S = 1.0


@dataclass
class _Peer:
    name: str
    epoch: int | None = None
    next_seq: int = 0
    awaiting_resync: bool = False
    contiguous: bool = False
    bye_seq: int | None = None
    pid: int | None = None
    rss: int = 0
    polls_applied: int = 0
    snapshots_applied: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    resync_asked_at: float = 0.0
    stale: bool = False
    # The source-stall count this peer last reported, and in which epoch
    # (the count restarts with every poller process).
    stalls: int = 0
    stalls_epoch: int | None = None


class StreamReceiver:
    """Binds ``endpoint`` and applies what pollers send to ``store``.

    ``curve`` makes the socket a CURVE server admitting only its allowed
    keys; ``pinned`` names peers never forgotten to make room for others (the
    buffer's own poller).
    """

    def __init__(self, store: PartitionStore, endpoint: str, *, limits: Limits = DEFAULT_LIMITS,
                 curve: CurveServer | None = None, stale_after: float = 5.0,
                 pinned: frozenset[str] = frozenset()) -> None:
        self._store = store
        self._requested_endpoint = endpoint
        self.limits = limits
        self._curve = curve
        self.stale_after = stale_after
        self._pinned = frozenset(name.encode() for name in pinned)
        self._gate: Gatekeeper | None = None
        self.endpoint: str | None = None
        self._commands: "queue.SimpleQueue[tuple[Any, ...]]" = queue.SimpleQueue()
        self._wake = WakePipe()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="replay-receiver", daemon=True)
        self._peers: dict[bytes, _Peer] = {}
        self._events = threading.Condition()
        self.messages = 0
        self.items_received = 0
        self.bytes_received = 0
        self.protocol_errors = 0
        self.source_errors = 0
        self.peers_forgotten = 0
        self.resyncs_requested = 0
        self.source_stalls = 0
        self.last_message_at: float | None = None
        self._stopped = False
        # identity -> the one epoch its own poller process uses (set by the
        # buffer that spawned it), and the epochs of its earlier processes.
        self._expected: dict[bytes, int] = {}
        self._retired: dict[bytes, set[int]] = {}
        # Set by stop_after_bye(): (identity, epoch) whose BYE ends the thread.
        self._last_bye: tuple[bytes, int | None] | None = None
        self._quit = False

    # -- control from other threads ---------------------------------------------

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

    def _command(self, *command: Any) -> None:
        self._commands.put(command)
        self._wake.poke()

    def send_control(self, peer: str, kind: Kind, reason: str) -> None:
        """Queue a STOP or RESYNC for ``peer``."""
        self._command("send", peer.encode(), kind, reason)

    def send_sync(self, peer: str, token: int) -> None:
        """Queue a SYNC ``token`` for ``peer``: it polls at once and tags that listing with the token."""
        self._command("sync", peer.encode(), token)

    def expect(self, peer: str, epoch: int) -> None:
        """From now on only ``epoch`` may speak as ``peer``; earlier epochs are dropped quietly.

        Called before the poller process with that epoch starts, so no message
        of it can arrive first.
        """
        identity = peer.encode()
        previous = self._expected.get(identity)
        if previous is not None:
            retired = self._retired.setdefault(identity, set())
            retired.add(previous)
            if len(retired) > 64:  # restarts are few; keep the set bounded anyway
                retired.discard(min(retired))
        self._expected[identity] = epoch

    def stop_after_bye(self, peer: str, epoch: int | None) -> None:
        """Let the thread end by itself once ``peer``'s BYE of ``epoch`` is applied.

        Closing the socket and context then overlaps the poller's exit
        instead of following it; :meth:`stop` still joins (or ends) the thread.
        """
        self._command("quit_after_bye", peer.encode(), epoch)

    def wait_bye(self, peer: str, epoch: int | None, timeout: float) -> bool:
        """Wait until ``peer``'s BYE of ``epoch`` was applied; True if no gap came before it."""
        state = self._wait_for(peer, lambda p: p.epoch == epoch and p.bye_seq is not None, timeout)
        return state is not None and state.contiguous

    def wait_first_poll(self, peer: str, timeout: float) -> bool:
        """Wait until ``peer`` has had one complete poll applied."""
        return self._wait_for(peer, lambda p: p.polls_applied > 0, timeout) is not None

    def _wait_for(self, peer: str, predicate: Callable[[_Peer], bool], timeout: float) -> _Peer | None:
        deadline = time.monotonic() + timeout
        identity = peer.encode()
        with self._events:
            while True:
                state = self._peers.get(identity)
                if state is not None and predicate(state):
                    return state
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return None
                self._events.wait(remaining)

    def peer_info(self, peer: str) -> _Peer | None:
        return self._peers.get(peer.encode())

    @property
    def auth_rejected(self) -> int:
        """Handshakes refused for want of an allowed CURVE key."""
        return self._gate.rejected if self._gate is not None else 0

    @property
    def curve_enabled(self) -> bool:
        return self._curve is not None

    @property
    def peer_count(self) -> int:
        """Pollers connected that have not said BYE (the state of those that did is kept for a restart)."""
        return sum(1 for peer in list(self._peers.values()) if peer.bye_seq is None)

    def stale_peers(self) -> list[str]:
        """Peers silent for more than ``stale_after`` seconds that never said BYE."""
        now = time.monotonic()
        return sorted(p.name for p in list(self._peers.values())
                      if p.bye_seq is None and now - p.last_seen > self.stale_after)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, close the socket, release the pipe. Idempotent."""
        if self._stopped:
            return
        if self._thread.is_alive():
            self._command("quit")
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("receiver thread did not stop within %ss", timeout)
                return
        # Only now: a stop() interrupted while joining (Ctrl-C) must be redone by the next one.
        self._stopped = True
        self._wake.close()

    # -- the thread -------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        gate: Gatekeeper | None = None
        try:
            gate = self._gate = Gatekeeper(ctx, self._curve)
            sock.setsockopt(zmq.LINGER, 0)
            # No ROUTER_HANDOVER: with it, a second connection using a name
            # silently cut the first one off for good (its messages went
            # nowhere). Without it the second one is refused while the first
            # lives; a restarted poller connects after its predecessor's
            # connection closed, and the heartbeats below free the name of a
            # peer that vanished without closing its connection.
            sock.setsockopt(zmq.RCVHWM, 10000)
            # libzmq drops (and disconnects) a sender of a bigger frame before
            # buffering it whole; decode() checks the same bound again.
            sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
            # ZMTP heartbeats drop connections whose far end vanished without a
            # FIN (a cut link, a dead host), so they do not pile up.
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(3000, int(self.stale_after * 1000)))
            gate.arm(sock)
            sock.bind(self._requested_endpoint)
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
            with self._events:
                self._events.notify_all()

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
        while True:
            events = dict(poller.poll(tick_ms))
            if self._wake.read_fd in events:
                self._wake.drain()
            if monitor is not None and monitor in events:
                self._gate.on_monitor()
            self._check_liveness()
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command[0] == "quit":
                    return
                if command[0] == "quit_after_bye":
                    _, identity, epoch = command
                    peer = self._peers.get(identity)
                    if peer is not None and peer.epoch == epoch and peer.bye_seq is not None:
                        return
                    self._last_bye = (identity, epoch)
                    continue
                if command[0] == "sync":
                    _, identity, token = command
                    self._send(sock, identity, Kind.SYNC, {"token": token})
                    continue
                _, identity, kind, reason = command
                self._send(sock, identity, kind, {"reason": reason})
            if sock in events:
                for _ in range(1000):  # bounded, so commands are never starved
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_frames(sock, frames)
                    if self._quit:
                        return

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.stale or peer.bye_seq is not None:
                continue
            silent = now - peer.last_seen
            if silent > self.stale_after:
                peer.stale = True
                logger.warning("no message from poller %s for %.1fs (stale_after=%gs): its link is down or it "
                               "is dead; the buffer keeps what it has", peer.name, silent, self.stale_after)

    def _peer(self, identity: bytes) -> _Peer:
        """The state of ``identity``, made on first sight within ``Limits.max_peers``."""
        peer = self._peers.get(identity)
        if peer is not None:
            return peer
        if len(self._peers) >= self.limits.max_peers:
            self._forget_one()
        peer = self._peers[identity] = _Peer(identity.decode(errors="replace"))
        return peer

    def _forget_one(self) -> None:
        """Drop the peer silent longest (never a pinned one); if it returns, it resyncs."""
        candidates = [(p.last_seen, identity) for identity, p in self._peers.items() if identity not in self._pinned]
        if not candidates:
            return
        _, identity = min(candidates)
        peer = self._peers.pop(identity)
        self._store.abandon_snapshot(peer.name)
        self.peers_forgotten += 1
        level = logging.WARNING if self.peers_forgotten <= 10 or self.peers_forgotten % 100 == 0 else logging.DEBUG
        logger.log(level, "more than %d peers: forgot the state of %s (silent longest)", self.limits.max_peers,
                   peer.name)

    def _send(self, sock: zmq.Socket, identity: bytes, kind: Kind, body: dict[str, Any]) -> None:
        peer = self._peers.get(identity)
        epoch = peer.epoch if peer and peer.epoch is not None else 0
        try:
            sock.send_multipart([identity, encode_header(kind, epoch, 0), encode_body(kind, body)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("could not send %s to %r: %s", kind.name, identity, exc)

    def _on_frames(self, sock: zmq.Socket, frames: list[Any]) -> None:
        identity = frames[0].bytes
        self.bytes_received += sum(len(f) for f in frames[1:])
        try:
            message = decode([f.buffer for f in frames[1:]], self.limits)
        except ProtocolError as exc:
            self._protocol_error(identity, str(exc))
            return
        expected = self._expected.get(identity)
        if expected is not None and message.epoch != expected:
            if message.epoch in self._retired.get(identity, ()):
                logger.debug("dropped a late %s from an earlier process of %r", message.kind.name, identity)
            else:
                self._protocol_error(identity, f"epoch {message.epoch} claims the identity of the buffer's "
                                               f"own poller (epoch {expected}); dropped")
            return
        self.messages += 1
        self.last_message_at = time.monotonic()
        peer = self._peer(identity)
        peer.last_seen = self.last_message_at
        if peer.stale:
            peer.stale = False
            logger.info("poller %s is back", peer.name)
        if message.kind in (Kind.STOP, Kind.RESYNC, Kind.SYNC):
            self._protocol_error(identity, f"{message.kind.name} is not a poller's message")
            return
        if not self._sequence_ok(sock, identity, peer, message):
            return
        handler = getattr(self, f"_on_{message.kind.name.lower()}")
        handler(sock, identity, peer, message)

    def _protocol_error(self, identity: bytes, why: str) -> None:
        self.protocol_errors += 1
        # Log the first few at WARNING, then only every hundredth: a hostile
        # peer must not be able to flood the trainer's log.
        level = logging.WARNING if self.protocol_errors <= 10 or self.protocol_errors % 100 == 0 else logging.DEBUG
        logger.log(level, "protocol error #%d from %r: %s", self.protocol_errors, identity, why)

    def _sequence_ok(self, sock: zmq.Socket, identity: bytes, peer: _Peer, message: Any) -> bool:
        if message.epoch != peer.epoch:
            if peer.epoch is not None:
                self._store.abandon_snapshot(peer.name)
            peer.epoch = message.epoch
            peer.bye_seq = None
            peer.next_seq = message.seq + 1
            if message.kind is Kind.READY and message.seq == 0:
                # A new poller process: its first poll is a full snapshot.
                peer.awaiting_resync = False
                peer.contiguous = True
                return True
            # Joined an epoch mid-stream (we restarted, or READY was lost).
            peer.contiguous = False
            self._request_resync(sock, identity, peer, "unknown epoch")
            return message.kind is not Kind.DELTA
        if message.seq < peer.next_seq:
            self._protocol_error(identity, f"replayed or out-of-order seq {message.seq} (expected {peer.next_seq})")
            return False
        if message.seq > peer.next_seq:
            logger.warning("gap in the stream from %s: expected seq %d, got %d; asking for a resync",
                           peer.name, peer.next_seq, message.seq)
            peer.contiguous = False
            peer.next_seq = message.seq + 1
            self._store.abandon_snapshot(peer.name)
            self._request_resync(sock, identity, peer, "sequence gap")
            return message.kind is not Kind.DELTA
        peer.next_seq += 1
        return True

    def _request_resync(self, sock: zmq.Socket, identity: bytes, peer: _Peer, why: str) -> None:
        peer.awaiting_resync = True
        peer.resync_asked_at = time.monotonic()
        self.resyncs_requested += 1
        self._send(sock, identity, Kind.RESYNC, {"reason": why})

    # -- per kind -----------------------------------------------------------------

    def _on_ready(self, sock: zmq.Socket, identity: bytes, peer: _Peer, message: Any) -> None:
        peer.pid = message.body["pid"]
        logger.debug("poller %s ready: pid %s epoch %s", peer.name, peer.pid, message.epoch)

    def _on_delta(self, sock: zmq.Socket, identity: bytes, peer: _Peer, message: Any) -> None:
        body = message.body
        self._store.poll_seen(peer.name, message.epoch, body["poll"])
        if peer.awaiting_resync:
            if not (body["full"] and body["reset"]):
                # Stale: everything until the snapshot is superseded by it. A
                # request can be lost (sent while the route was down), so ask
                # again now and then rather than wait forever.
                if time.monotonic() - peer.resync_asked_at > _RESYNC_RETRY_S:
                    self._request_resync(sock, identity, peer, "resync still awaited")
                return
            peer.awaiting_resync = False
        if body["full"] and body["reset"]:
            self._store.begin_snapshot(peer.name)
        for partition_id, items in body["upserts"].items():
            self.items_received += len(items)
            self._store.merge_listed(peer.name, partition_id, items)
        for partition_id, keys in body["deletes"].items():
            self.items_received += len(keys)
            self._store.unlist(peer.name, partition_id, keys)
        if body["end"]:
            if body["full"]:
                self._store.end_snapshot(peer.name)
                peer.snapshots_applied += 1
            self._store.poll_completed(peer.name, message.epoch, body["poll"], body.get("sync"))
            if peer.polls_applied == 0:
                with self._events:
                    peer.polls_applied += 1
                    self._events.notify_all()
            else:
                peer.polls_applied += 1

    def _on_heartbeat(self, sock: zmq.Socket, identity: bytes, peer: _Peer, message: Any) -> None:
        peer.rss = message.body["rss"]
        stalls = message.body.get("source_stalls")  # absent from older pollers
        if stalls is not None:
            if peer.stalls_epoch != message.epoch:
                peer.stalls_epoch, peer.stalls = message.epoch, 0
            if stalls > peer.stalls:
                self.source_stalls += stalls - peer.stalls
                peer.stalls = stalls

    def _on_error(self, sock: zmq.Socket, identity: bytes, peer: _Peer, message: Any) -> None:
        body = message.body
        self.source_errors += 1
        logger.log(logging.ERROR if body["fatal"] else logging.WARNING,
                   "poller %s: kv_list() failed%s: %s: %s", peer.name,
                   " for good" if body["fatal"] else f" ({body.get('count', '?')} in a row), retrying",
                   body["type"], body["message"])

    def _on_bye(self, sock: zmq.Socket, identity: bytes, peer: _Peer, message: Any) -> None:
        with self._events:
            peer.bye_seq = message.body["last_seq"]
            peer.contiguous = peer.contiguous and not peer.awaiting_resync and peer.bye_seq == message.seq - 1
            self._events.notify_all()
        if self._last_bye == (identity, message.epoch):
            self._quit = True
        logger.debug("poller %s said BYE: %s", peer.name, message.body["reason"])

    def _on_log(self, sock: zmq.Socket, identity: bytes, peer: _Peer, message: Any) -> None:
        body = message.body
        logging.getLogger("poller").log(body["level"], "[poller %s] %s: %s", peer.name, body["name"], body["message"])
