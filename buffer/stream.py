"""The trainer's receiver: its ROUTER socket, the peers streaming to it, each message checked in sequence and applied.

:class:`PeerTable` is the peer state machine, with no sockets: an identity, its frames and the time in; the stream
applied to the :class:`~buffer.store.PartitionStore` and the control messages to send back (:class:`Send`) out.
:class:`StreamReceiver` is the one thread that owns the ROUTER socket and moves frames between it and the table;
other threads reach it only through a command queue and a wake-up pipe, so only the thread that made it uses it.

Recovery rules (a stream must converge to its source, whatever was lost):

- a sequence gap, or an epoch joined mid-stream, asks for a RESYNC (a full snapshot) and ignores deltas
  until one starts (a snapshot's start is itself the answer); so does a stale peer speaking again;
- a heartbeat's ``last_seq`` is answered with ACK (how a poller on a new connection learns it was
  admitted, :mod:`poller.link`); one that does not match what was received is a gap;
- an unanswered RESYNC or SYNC is asked again every second (:meth:`PeerTable.tick`): a request sent
  while the route was down is lost.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import zmq

from buffer.access import EndpointInUseError, Gatekeeper, claim_ipc_path, restrict_ipc_socket
from buffer.metrics import ListingFigures
from buffer.ratelimit import MAX_FORWARDED_CHARS, LogLimiter, clamp_level
from buffer.store import PartitionStore
from poller.common.wakeup import WakePipe
from poller.wire.curve import CurveServer
from poller.wire.errors import ProtocolError
from poller.wire.protocol import (
    Ack,
    Body,
    Bye,
    Delta,
    Error,
    Heartbeat,
    Kind,
    Limits,
    Log,
    Message,
    Ready,
    Resync,
    Sync,
    Watch,
    decode,
    encode_body,
    encode_header,
)

__all__ = ["StreamReceiver", "PeerTable", "Peer", "Send", "RESYNC_RETRY_S", "SYNC_RETRY_S"]

logger = logging.getLogger(__name__)

#: How long a RESYNC or a SYNC may stay unanswered before it is asked for again.
RESYNC_RETRY_S = SYNC_RETRY_S = 1.0


class Send(NamedTuple):
    """An action: send ``kind`` with ``body`` to the peer ``identity``."""

    identity: bytes
    kind: Kind
    epoch: int
    body: Body


def _snapshot_start(message: Message) -> bool:
    return isinstance(message.body, Delta) and message.body.full and message.body.reset


@dataclass
class Peer:
    """One stream's state; ``stream`` is its name (the identity the poller connects with)."""

    stream: str
    epoch: int | None = None
    next_seq: int = 0
    awaiting_resync: bool = False
    contiguous: bool = False
    bye_seq: int | None = None
    rss: int = 0
    polls_applied: int = 0
    snapshots_applied: int = 0
    # When its last complete poll's listing began, on this process's time.monotonic() (_on_delta).
    listed_at: float | None = None
    last_seen: float = field(default_factory=time.monotonic)
    resync_asked_at: float = 0.0
    stale: bool = False
    # A standalone poller first heard of, or silent so long that what only it listed was dropped (Ledger.withdraw):
    # it vouches for nothing until it lists anew, a listing that answers ``relist_token`` (one begun before, or a
    # resend of an older poll, may predate a removal the ledger no longer remembers).
    relist: bool = False
    withdrawn: bool = False
    relist_token: int = 0
    # The source stalls of poller process ``stalls_epoch``, and its quarantine, as its last heartbeat said.
    stalls: int = 0
    stalls_epoch: int | None = None
    quarantined: int = 0
    quarantined_keys: list[tuple[str, str, str]] = field(default_factory=list)
    # How long its source call under way had run, and when that was heard (its last heartbeat).
    call_s: float = 0.0
    call_heard: float = 0.0
    listing: ListingFigures = field(default_factory=ListingFigures)

    def report(self, epoch: int, beat: Heartbeat) -> int:
        """Keep what heartbeat ``beat`` of poller process ``epoch`` says; return the source stalls new in it."""
        self.rss = beat.rss
        self.quarantined = beat.quarantined
        self.quarantined_keys = [(p, k, why) for p, k, why in beat.quarantined_keys]
        self.listing.report(epoch, beat.listings, beat.listing_s, beat.listing_total_s, beat.listing_share,
                            beat.watch_reads, beat.watch_listings)
        before = self.stalls if self.stalls_epoch == epoch else 0  # each poller process counts from 0
        self.stalls_epoch, self.stalls = epoch, max(before, beat.source_stalls)
        return self.stalls - before


class PeerTable:
    """Per-peer stream state, applied to ``store``.

    ``pinned`` names peers never forgotten to make room for others (the buffer's own poller);
    ``on_change`` is called after a BYE or a first complete poll was applied, for threads waiting on those.
    """

    def __init__(self, store: PartitionStore, *, stale_after: float = 5.0,
                 pinned: frozenset[bytes] = frozenset(), on_change: Callable[[], None] = lambda: None,
                 log: LogLimiter | None = None) -> None:
        self._store = store
        self.stale_after = stale_after
        self._pinned = pinned
        self._on_change = on_change
        # Forwarded LOG records get more room: a poller_log_level of INFO is a choice, not a flood.
        self._log = log or LogLimiter(logger, budgets={"log": (100, 60.0)})
        self.peers: dict[bytes, Peer] = {}
        self.messages = 0
        self.items_received = 0
        self.bytes_received = 0
        self.protocol_errors = 0
        self.source_errors = 0
        self.resyncs_requested = 0
        self.source_stalls = 0
        self.last_message_at: float | None = None
        # identity -> the one epoch the buffer's own poller process uses, and its earlier processes'.
        self._expected: dict[bytes, int] = {}
        self._retired: dict[bytes, set[int]] = {}
        # identity -> (the highest SYNC token asked and not yet answered, when it was last sent, whether a poll was
        # asked for: not only marks), and the partitions every SYNC to it names.
        self._syncs: dict[bytes, tuple[int, float, bool]] = {}
        self._sync_partitions: dict[bytes, list[str]] = {}

    def expect(self, identity: bytes, epoch: int) -> None:
        """From now on only ``epoch`` may speak as ``identity``; earlier epochs are dropped quietly."""
        previous = self._expected.get(identity)
        if previous is not None:
            retired = self._retired.setdefault(identity, set())
            retired.add(previous)
            if len(retired) > 64:  # restarts are few; keep the set bounded anyway
                retired.discard(min(retired))
        self._expected[identity] = epoch

    def quarantined(self) -> tuple[int, list[tuple[str, str, str]]]:
        """Keys left out of the stream by the peers still streaming: the count, and the ones named."""
        live = [p for p in list(self.peers.values()) if p.bye_seq is None]
        return sum(p.quarantined for p in live), [named for p in live for named in p.quarantined_keys]

    def stale_peers(self, now: float) -> list[str]:
        """Peers silent for more than ``stale_after`` seconds that never said BYE."""
        return sorted(p.stream for p in list(self.peers.values())
                      if p.bye_seq is None and now - p.last_seen > self.stale_after)

    @property
    def limits(self) -> Limits:
        """The decoding bounds: the store's, which unpacks within the same ones."""
        return self._store.limits

    def sync(self, identity: bytes, token: int, now: float, mark: bool = False) -> Send:
        """A SYNC for ``identity`` (``token``, or a higher one not answered yet), asked again by :meth:`tick`.
        A ``mark`` asks for no poll now: the next one as scheduled answers it (unless a poll was asked already)."""
        asked = self._syncs.get(identity)
        if asked is not None and self._store.synced(identity.decode(errors="replace")) >= asked[0]:
            asked = None  # answered already (tick() has not forgotten it yet)
        if asked is not None:
            token, mark = max(token, asked[0]), mark and not asked[2]
        self._syncs[identity] = (token, now, not mark)
        return Send(identity, Kind.SYNC, self._epoch(identity),
                    Sync(token, self._sync_partitions.get(identity, []), mark))

    def marks(self, token: int, now: float) -> list[Send]:
        """A removal's token for every poller that may still list what it removed (not withdrawn, no BYE)."""
        return [self.sync(identity, token, now, mark=True) for identity, peer in list(self.peers.items())
                if peer.bye_seq is None and not peer.withdrawn and peer.epoch is not None]

    def include_partitions(self, identity: bytes, partition_ids: Sequence[str]) -> None:
        """Every SYNC to ``identity`` from now on names these partitions too (a set that only grows); called
        directly, not through the receiver's command queue: the dict entry is replaced GIL-atomically."""
        held = self._sync_partitions.get(identity, [])
        self._sync_partitions[identity] = held + sorted(set(partition_ids) - set(held))

    def watch(self, identity: bytes, partition: str, keys: list[str], seconds: float, every: float) -> Send:
        """A WATCH for ``identity``: read ``keys`` of ``partition`` while a decision waits on them (poller.watch)."""
        return Send(identity, Kind.WATCH, self._epoch(identity), Watch(partition, keys, seconds, every))

    def _epoch(self, identity: bytes) -> int:
        """The epoch a control message to ``identity`` is stamped with (0 before it spoke)."""
        peer = self.peers.get(identity)
        return peer.epoch if peer is not None and peer.epoch is not None else 0

    # -- time -------------------------------------------------------------------

    def tick(self, now: float) -> list[Send]:
        """Mark silent peers stale; ask again for RESYNCs and SYNCs left unanswered."""
        actions = []
        for identity, peer in list(self.peers.items()):
            silent = now - peer.last_seen
            if peer.bye_seq is not None:
                self._withdraw_if_gone(identity, peer, silent)
                continue
            if not peer.stale and silent > self.stale_after and peer.bye_seq is None:
                peer.stale = True
                if identity not in self._pinned:
                    # No full listing of it is awaited; what only it lists holds decisions back (Ledger.view_stale).
                    self._store.release(peer.stream)
                # Its store's view is not fresh: the own poller's, or where a standalone one alone lists keys.
                self._store.not_answering(peer.stream, peer.last_seen,
                                          f"its poller has sent nothing for more than stale_after="
                                          f"{self.stale_after:g}s")
                self._log.log("stale", logging.WARNING,
                              "no message from poller %s for %.1fs (stale_after=%gs): its link is down or it is "
                              "dead; the buffer keeps what it has", peer.stream, silent, self.stale_after)
            self._withdraw_if_gone(identity, peer, silent)
            if peer.awaiting_resync and not peer.stale and now - peer.resync_asked_at > RESYNC_RETRY_S:
                actions.append(self._request_resync(identity, peer, "resync still awaited", now, retry=True))
        for identity, (token, sent_at, poll) in list(self._syncs.items()):
            if self._store.synced(identity.decode(errors="replace")) >= token:
                del self._syncs[identity]
            elif now - sent_at > SYNC_RETRY_S:
                actions.append(self.sync(identity, token, now, mark=not poll))
        return actions

    def _withdraw_if_gone(self, identity: bytes, peer: Peer, silent: float) -> None:
        """Withdraw a standalone poller silent (or gone with BYE) past ``max_view_age``: what only it listed is
        dropped, so decisions go on without it; back, it lists anew."""
        max_age = self._store.ledger.max_age
        if identity in self._pinned or peer.withdrawn or max_age is None or silent <= max_age:
            return
        peer.withdrawn = peer.relist = True
        dropped = self._store.withdraw(peer.stream)
        self._log.log("withdraw", logging.WARNING,
                      "poller %s has sent nothing for %.0fs (max_view_age=%gs): dropped the %d key(s) only it "
                      "listed; if it returns, it lists anew", peer.stream, silent, max_age, dropped)

    # -- messages -----------------------------------------------------------------

    def on_frames(self, identity: bytes, frames: Sequence[bytes | memoryview], now: float) -> list[Send]:
        """Decode and apply one message from ``identity``; return what to send back."""
        self.bytes_received += sum(len(f) for f in frames)
        try:
            message = decode(frames, self.limits)
        except ProtocolError as exc:
            self.protocol_error(identity, str(exc))
            return []
        return self.on_message(identity, message, now)

    def on_message(self, identity: bytes, message: Message, now: float) -> list[Send]:
        """Apply one decoded message from ``identity``; return what to send back."""
        expected = self._expected.get(identity)
        if expected is not None and message.epoch != expected:
            if message.epoch in self._retired.get(identity, ()):
                logger.debug("dropped a late %s from an earlier process of %r", message.kind.name, identity)
            else:
                self.protocol_error(identity, f"epoch {message.epoch} claims the identity of the buffer's "
                                              f"own poller (epoch {expected}); dropped")
            return []
        self.messages += 1
        self.last_message_at = now
        peer = self._peer(identity, now)
        came_back = peer.stale
        peer.last_seen = now
        if came_back:
            peer.stale = False
            logger.info("poller %s is back", peer.stream)
        if message.kind >= Kind.STOP:  # a buffer's message (poller.wire.protocol.Kind)
            self.protocol_error(identity, f"{message.kind.name} is not a poller's message")
            return []
        actions: list[Send] = []
        in_sequence = self._sequence_ok(identity, peer, message, now, actions)
        if peer.relist:
            self._relist(identity, peer, now, actions)  # its deltas are ignored until the new listing (_on_delta)
        if not in_sequence:
            return actions
        if came_back and not peer.awaiting_resync:
            fresh = message.kind is Kind.READY and message.seq == 0
            if not (fresh or _snapshot_start(message) or peer.awaiting_resync):
                # Silence can hide loss the sequence cannot show (a poller refused on redial streamed nowhere).
                actions.append(self._request_resync(identity, peer, "silent peer came back", now))
                if message.kind is Kind.DELTA:
                    return actions
        match message.body:
            case Ready() as ready:
                logger.debug("poller %s ready: pid %s epoch %s", peer.stream, ready.pid, message.epoch)
            case Delta() as delta:
                self._on_delta(identity, peer, message, delta, now, actions)
            case Heartbeat() as beat:
                self._on_heartbeat(identity, peer, message, beat, now, actions)
            case Error() as error:
                self._on_error(peer, error, now)
            case Bye() as bye:
                self._on_bye(identity, peer, message, bye, now)
            case Log() as record:
                self._log.log("log", clamp_level(record.level), "[poller %s] %s: %s", peer.stream, record.name[:200],
                              record.message[:MAX_FORWARDED_CHARS], logger=logging.getLogger("poller"))
        return actions

    def _relist(self, identity: bytes, peer: Peer, now: float, actions: list[Send]) -> None:
        """A standalone poller speaks, first or after it was withdrawn: ask for a listing that answers a new sync
        token, and a snapshot; until a snapshot answering it starts, its deltas are ignored (a RESYNC answered
        with the last poll sent again is refused, and asked again until the listing answering the token is)."""
        peer.relist = peer.withdrawn = False
        peer.relist_token = self._store.issue_token()
        actions.insert(0, self.sync(identity, peer.relist_token, now))  # before any RESYNC
        # No loss to count: a first listing, or one after the buffer let the poller go.
        actions.append(self._request_resync(identity, peer, "a standalone poller lists anew (first heard of, or "
                                                            "withdrawn)", now, retry=True))

    def protocol_error(self, identity: bytes, why: str) -> None:
        self.protocol_errors += 1
        self._log.log("protocol", logging.WARNING, "protocol error #%d from %r: %s", self.protocol_errors, identity,
                      why)

    def _peer(self, identity: bytes, now: float) -> Peer:
        """The state of ``identity``, made on first sight within ``Limits.max_peers``."""
        peer = self.peers.get(identity)
        if peer is not None:
            return peer
        if len(self.peers) >= self.limits.max_peers:
            self._forget_one()
        peer = self.peers[identity] = Peer(identity.decode(errors="replace"), last_seen=now,
                                           relist=identity not in self._pinned)
        return peer

    def _forget_one(self) -> None:
        """Drop the peer silent longest (never a pinned one); if it returns, it resyncs."""
        candidates = [(p.last_seen, identity) for identity, p in self.peers.items() if identity not in self._pinned]
        if not candidates:
            return
        _, identity = min(candidates)
        peer = self.peers.pop(identity)
        self._store.withdraw(peer.stream)
        self._log.log("forget", logging.WARNING, "more than %d peers: forgot the state of %s (silent longest)",
                      self.limits.max_peers, peer.stream)

    def _sequence_ok(self, identity: bytes, peer: Peer, message: Message, now: float, actions: list[Send]) -> bool:
        """Check epoch and seq; False drops the message (a RESYNC may have been asked for)."""
        if message.epoch != peer.epoch:
            if peer.epoch is not None:
                self._store.abandon_snapshot(peer.stream)
            self._store.announce(peer.stream, message.epoch)
            peer.epoch = message.epoch
            peer.bye_seq = None
            peer.next_seq = message.seq + 1
            if message.kind is Kind.READY and message.seq == 0:
                # A new poller process: its first poll is a full snapshot, a listing it makes anew.
                peer.awaiting_resync = False
                peer.contiguous = True
                return True
            # Joined an epoch mid-stream (we restarted, or READY was lost).
            peer.contiguous = False
            return self._resync_unless_snapshot(identity, peer, message, "unknown epoch", now, actions)
        if message.seq < peer.next_seq:
            self.protocol_error(identity, f"replayed or out-of-order seq {message.seq} (expected {peer.next_seq})")
            return False
        if message.seq > peer.next_seq:
            self._log.log("gap", logging.WARNING, "gap in the stream from %s: expected seq %d, got %d; asking for a "
                          "resync", peer.stream, peer.next_seq, message.seq)
            peer.contiguous = False
            peer.next_seq = message.seq + 1
            self._store.abandon_snapshot(peer.stream)
            return self._resync_unless_snapshot(identity, peer, message, "sequence gap", now, actions)
        peer.next_seq += 1
        return True

    def _resync_unless_snapshot(self, identity: bytes, peer: Peer, message: Message, why: str, now: float,
                                actions: list[Send]) -> bool:
        if _snapshot_start(message):
            # The poller is already sending what a RESYNC would ask for.
            peer.awaiting_resync = True  # cleared by _on_delta as the snapshot starts
            return True
        actions.append(self._request_resync(identity, peer, why, now))
        return message.kind is not Kind.DELTA

    def _request_resync(self, identity: bytes, peer: Peer, why: str, now: float, retry: bool = False) -> Send:
        peer.awaiting_resync = True
        self._store.mark_broken(peer.stream)
        peer.resync_asked_at = now
        if not retry:  # counts the resyncs needed, not the requests repeated while one is awaited
            self.resyncs_requested += 1
        last_seq = peer.next_seq - 1 if peer.epoch is not None else -1
        return Send(identity, Kind.RESYNC, self._epoch(identity), Resync(why, last_seq))

    # -- per kind -----------------------------------------------------------------

    def _on_delta(self, identity: bytes, peer: Peer, message: Message, body: Delta, now: float,
                  actions: list[Send]) -> None:
        if peer.awaiting_resync:
            if not _snapshot_start(message) or body.sync < peer.relist_token:
                # Superseded by the snapshot asked for (tick() asks again if it is lost).
                self._store.apply(peer.stream, message.epoch, body, superseded=True)
                return
            peer.awaiting_resync = False
            peer.relist_token = 0
        if body.full and body.reset:
            peer.contiguous = True  # whatever was lost before, the snapshot replaces (close(): drained=True)
        self.items_received += sum(len(keys) for keys, _ in body.packed.values()) + sum(map(len, body.deletes.values()))
        try:
            self._store.apply(peer.stream, message.epoch, body)
        except ProtocolError as exc:  # tags the decoder refuses: the store holds the stream broken
            self.protocol_error(identity, f"{exc}; asking for a resync")
            peer.contiguous = False
            actions.append(self._request_resync(identity, peer, "undecodable tags", now))
            return
        if body.end:
            if body.full:
                peer.snapshots_applied += 1
            peer.polls_applied += 1
            # The poller's wall-clock stamp, moved to the monotonic clock; one from the future (a clock set
            # back, another machine's) counts as now: never fresher than the poll's applying.
            peer.listed_at = now - max(0.0, time.time() - body.t)
            if peer.polls_applied == 1:
                self._on_change()

    def _on_heartbeat(self, identity: bytes, peer: Peer, message: Message, beat: Heartbeat, now: float,
                      actions: list[Send]) -> None:
        stalls = peer.report(message.epoch, beat)
        peer.call_s, peer.call_heard = beat.stalled_s, now
        if stalls:
            self.source_stalls += stalls
            # A stalled call: no decision on this store's view until it answers again (a whole poll).
            self._store.not_answering(peer.stream, now - beat.stalled_s,
                                      f"kv_list() stalled, {peer.stalls} stalled call(s) so far")
        if beat.last_seq != message.seq - 1 and not peer.awaiting_resync:  # it sent other messages than we counted
            actions.append(self._request_resync(identity, peer, "heartbeat last_seq mismatch", now))
        actions.append(Send(identity, Kind.ACK, message.epoch, Ack(message.seq)))

    def _on_error(self, peer: Peer, error: Error, now: float) -> None:
        self.source_errors += 1
        self._store.not_answering(peer.stream, now, f"kv_list() failed: {error.type[:200]}")
        self._log.log("error", logging.ERROR if error.fatal else logging.WARNING,
                      "poller %s: kv_list() failed%s: %s: %s", peer.stream,
                      " for good" if error.fatal else f" ({error.count} in a row), retrying",
                      error.type[:200], error.message[:MAX_FORWARDED_CHARS])

    def _on_bye(self, identity: bytes, peer: Peer, message: Message, bye: Bye, now: float) -> None:
        peer.bye_seq = bye.last_seq
        if identity not in self._pinned:
            # Gone on purpose: what only it lists holds decisions back until it lists again or is withdrawn.
            self._store.release(peer.stream)
            self._store.not_answering(peer.stream, now, "its poller said BYE")
        peer.contiguous = peer.contiguous and not peer.awaiting_resync and peer.bye_seq == message.seq - 1
        logger.debug("poller %s said BYE: %s", peer.stream, bye.reason)
        self._on_change()


class StreamReceiver:
    """Binds ``endpoint`` and applies what pollers send to ``store``; ``curve`` admits only its allowed keys,
    ``pinned`` names peers never forgotten to make room for others (the buffer's own poller)."""

    def __init__(self, store: PartitionStore, endpoint: str, *, curve: CurveServer | None = None,
                 stale_after: float = 5.0, pinned: frozenset[str] = frozenset()) -> None:
        self._requested_endpoint = endpoint
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
        self.table = PeerTable(store, stale_after=stale_after,
                               pinned=frozenset(name.encode() for name in pinned), on_change=self._notify)
        self._stopped = False
        # Set by stop_after_bye(): (identity, epoch) whose BYE ends the thread, and what to run then.
        self._last_bye: tuple[bytes, int | None] | None = None
        self._after_bye: Callable[[], None] | None = None
        self._ended_on_bye = False

    @property
    def limits(self) -> Limits:
        """The decoding bounds, the store's (:attr:`PeerTable.limits`)."""
        return self.table.limits

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

    def send_marks(self, token: int) -> None:
        """Queue a removal's token for every poller (:meth:`PeerTable.marks`); called under the store's lock."""
        self._command(lambda: self.table.marks(token, time.monotonic()))

    def send_watch(self, peer: str, partition: str, keys: list[str], seconds: float, every: float) -> None:
        """Queue a WATCH for ``peer``: read ``keys`` for ``seconds`` and list as soon as one changed, no sooner than
        ``every`` after the last listing a change brought forward (no keys: stop)."""
        identity = peer.encode()
        self._command(lambda: [self.table.watch(identity, partition, keys, seconds, every)])

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
        with self._events:
            while True:
                state = self.peer_info(peer)
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
