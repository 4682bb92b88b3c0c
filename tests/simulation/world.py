"""The simulated world: a real SQLite store, pollers stepped by hand, a network of queues, the trainer's buffer,
and the oracle that checks the view after every step.

Every operation is a plain tuple (``("put", "train", ("k1",), "running", 2)``) that :meth:`World.do` carries out,
or declines when it does not apply now (a delivery with nothing queued): a schedule can be replayed, and shrunk by
leaving operations out. Randomness lives in the scheduler (:mod:`tests.simulation.explore`), never here.

The oracle (docs/how-it-works.md, "Guarantees and their bounds"), checked after every operation:

- **(a) read your writes.** When a ``sync()`` is answered, the view equals the store for every key not written
  since the call began: its tags (a tag the trainer ``add()``-ed aside), or absent when the store does not hold
  it readably, or holds a version the trainer removed.
- **(b) removals.** A version the trainer removed is not shown while a stream still lists it (the tombstone ends
  when no stream lists the key).
- **(c) freshness.** A view called whole and fresh holds no key that only silent or gone streams vouch for.
- **(d) records.** No record's content causes a source error, a protocol error or a restart; the store's own
  writers keep working whatever another tool did to its file.
- **(e) memory.** Tombstones are bounded by the keys held, the keys the live streams list, and the removals a
  live stream's poll under way may still answer; the peers by the pollers.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections import deque
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

from buffer.sampling import SamplingAccess
from buffer.steps import StepSampler
from buffer.store import PartitionStore
from buffer.stream import Peer, PeerTable, Send
from buffer.sync import ListingSync, SyncRequest
from poller.faults import store as store_faults
from poller.polling import PollingThread
from poller.sources.sqlite import SqliteSource
from poller.wire.errors import ProtocolError
from poller.wire.protocol import Error, Heartbeat, Kind, Ready, Resync, Sync, decode, encode_body, encode_header
from poller.worker import resync_answered

__all__ = ["Config", "Op", "Violation", "World", "PARTITIONS", "KEYS", "POISONS", "LOG_EDITS"]

Op = tuple[Any, ...]
Name = tuple[str, str]  # (partition, key)

PARTITIONS = ("train", "val", "p2")
KEYS = tuple(f"k{i}" for i in range(6))
STATUSES = ("running", "success", "failure")
#: Rows another tool writes that the store cannot read, each quarantined (never in the view).
POISONS = ("not-json", "array", "deep", "deep2000", "not-utf8", "blob-key")
#: What another tool does to the change log.
LOG_EDITS = ("trim", "empty", "drop", "forget-deletes", "vacuum")

STALE_AFTER = 5.0
MAX_VIEW_AGE = 60.0
HEARTBEAT_S = 1.0
#: ZeroMQ's heartbeat drops a connection silent this long, with what was queued on it (poller.link).
LINK_LOST_AFTER = 3.0
#: A tombstone holding more versions than this is a leak (each removal of a name adds the ones listed then).
MAX_TOMB_VERSIONS = 16


class ToolRefused(Exception):
    """Another tool's write failed because a tool dropped the change log the triggers write to."""


class Violation(AssertionError):
    """A guarantee broken: ``kind`` names how (``rule:what``, the rule the oracle's letter), ``text`` what was seen."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(f"({kind}) {text}")
        self.kind = kind
        self.rule = kind.split(":")[0]
        self.text = text


@dataclass(frozen=True)
class Config:
    """One simulated deployment: the buffer's own poller (its source: ``feed``, ``listing`` or none) and the
    standalone pollers of the same store; ``schedule`` weighs the operations (``fast``: polls after nearly every
    write; ``slow``: many writes and trainer calls between two polls)."""

    own: str | None
    standalone: tuple[str, ...]
    schedule: str

    def describe(self) -> str:
        return (f"own poller: {self.own or 'none (source=None)'}; standalone: {list(self.standalone) or 'none'}; "
                f"schedule: {self.schedule}")


def canonical(tags: Mapping[str, Any]) -> str:
    return json.dumps(tags, sort_keys=True)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


class ListingOnly:
    """The SQLite store seen through ``kv_list()`` alone, as a store without a change feed is (TransferQueue)."""

    def __init__(self, path: str) -> None:
        self._store = SqliteSource(path)

    def kv_list(self) -> Any:
        return self._store.kv_list()

    def close(self) -> None:
        self._store.close()


# -- the store ---------------------------------------------------------------------------------------------------

@dataclass
class Truth:
    """What the store holds now: readable tags by name, and the names of rows nobody can read."""

    readable: dict[Name, dict[str, Any]]
    #: Rows nobody can read, by their names as stored: (partition type, its bytes, key type, its bytes).
    unreadable: set[tuple[str, bytes, str, bytes]]

    def blocks(self, partition: str, key: str) -> bool:
        """Whether ``key`` is stored, as text, with tags the store cannot read (a put cannot merge into them)."""
        return ("text", partition.encode(), "text", key.encode()) in self.unreadable


class Store:
    """The real SQLite file: written through :class:`SqliteSource` and by another tool (plain :mod:`sqlite3`)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "kv.db")
        self.backup_path = os.path.join(directory, "backup.db")
        self.api = SqliteSource(self.path)
        self.api.kv_list()  # the file and its change log
        self.writes = 0
        self.has_backup = False

    def close(self) -> None:
        self.api.close()

    def tags(self, status: str, step: int) -> dict[str, Any]:
        """New tags: every version is unique (``w``), so that a version shown again is the same record."""
        self.writes += 1
        return {"status": status, "global_steps": step, "w": self.writes}

    def truth(self) -> Truth:
        readable: dict[Name, dict[str, Any]] = {}
        unreadable: set[tuple[str, bytes, str, bytes]] = set()
        with closing(sqlite3.connect(self.path)) as conn:
            rows = conn.execute("SELECT typeof(partition_id), CAST(partition_id AS BLOB), typeof(key),"
                                " CAST(key AS BLOB), CAST(tags AS BLOB) FROM kv").fetchall()
        for ptype, partition, ktype, key, tags in rows:
            try:
                if ptype != "text" or ktype != "text":
                    raise ValueError("not text")
                name = (partition.decode(), key.decode())
                value = json.loads(tags.decode())
                if not isinstance(value, dict) or _depth(value) > 8:
                    raise ValueError("not plain tags")
            except (ValueError, UnicodeDecodeError, RecursionError):
                unreadable.add((ptype, bytes(partition), ktype, bytes(key)))
                continue
            readable[name] = value
        return Truth(readable, unreadable)

    def tool(self, *statements: tuple[str, tuple[Any, ...]]) -> None:
        """Run ``statements`` in one transaction from another program's connection.

        Raises:
            ToolRefused: the store's triggers need the change log another tool dropped (the store mends it at its
                next read or write; a program of its own cannot write meanwhile).
        """
        with closing(sqlite3.connect(self.path, isolation_level=None, timeout=10.0)) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    conn.execute(sql, params)
            except sqlite3.OperationalError as exc:
                conn.execute("ROLLBACK")
                if "no such table" in str(exc):
                    raise ToolRefused(str(exc)) from exc
                raise
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def edit_log(self, edit: str) -> None:
        """What another tool does to the change log (:data:`LOG_EDITS`)."""
        if edit == "vacuum":
            with closing(sqlite3.connect(self.path, isolation_level=None, timeout=10.0)) as conn:
                conn.execute("VACUUM")
            return
        sql = {"trim": "DELETE FROM kv_versions WHERE version < (SELECT max(version) - 2 FROM kv_versions)",
               "empty": "DELETE FROM kv_versions",
               "drop": "DROP TABLE IF EXISTS kv_versions",
               "forget-deletes": "DELETE FROM kv_deleted"}[edit]
        self.tool((sql, ()))

    def poison(self, partition: str, key: str, kind: str) -> None:
        """Another tool's row that cannot be read (:data:`POISONS`), in place of ``key``'s if it exists."""
        if kind == "blob-key":
            self.tool(("INSERT OR REPLACE INTO kv (partition_id, key, tags) VALUES (?, CAST(? AS BLOB), '{}')",
                       (partition, key.encode())))
            return
        tags = {"not-json": "'not json {'", "array": "'[1, 2]'", "deep": f"'{_nested(200)}'",
                "deep2000": f"'{_nested(2000)}'", "not-utf8": "CAST(X'7b22ff227d' AS TEXT)"}[kind]
        self.tool((f"INSERT OR REPLACE INTO kv (partition_id, key, tags) VALUES (?, ?, {tags})", (partition, key)))

    def backup(self) -> None:
        store_faults.backup(self.path, self.backup_path)
        self.has_backup = True

    def restore(self) -> None:
        store_faults.restore(self.path, self.backup_path)


# -- the network and the pollers ---------------------------------------------------------------------------------

@dataclass
class Frames:
    """One message on its way to the buffer; a poll's last DELTA carries what that poll listed (the model)."""

    frames: list[bytes]
    kind: Kind
    listing: dict[Name, str] | None = None


class SimPoller:
    """One poller (the buffer's own, or a standalone one of the same store), a process at a time: the real
    :class:`PollingThread` stepped by hand, its messages stamped as :class:`poller.link.Outbox` stamps them."""

    def __init__(self, world: World, name: str, kind: str, own: bool) -> None:
        self.world = world
        self.name = name
        self.identity = name.encode()
        self.kind = kind
        self.own = own
        self.state = "down"  # running, stopped (SIGSTOP), down (not started, killed, or ended)
        self.thread: PollingThread | None = None
        self.source: Any = None
        self.epoch = 0
        self.seq = -1
        self.snapshot_seq = -1
        self.next_full = True
        self.outq: deque[Frames] = deque()
        self.inq: deque[Send] = deque()
        self.last_beat = 0.0
        self.stopped_at = 0.0
        self.last_listing: dict[Name, str] = {}
        self.restarts = 0

    def __repr__(self) -> str:
        return f"<{self.name} {self.state} epoch={self.epoch} seq={self.seq} queued={len(self.outq)}>"

    # -- the process ------------------------------------------------------------------

    def start(self) -> None:
        world = self.world
        world.epochs += 1
        self.epoch = world.epochs
        if self.own:
            world.table.expect(self.identity, self.epoch)
        self.source = SqliteSource(world.store.path) if self.kind == "feed" else ListingOnly(world.store.path)
        self.thread = PollingThread(self.source, self._hand_over, poll_interval=1.0, listing_share=1.0)
        self.seq = -1
        self.snapshot_seq = -1
        self.next_full = True
        self.last_listing = {}
        self.state = "running"
        self._queue(Kind.READY, encode_body(Kind.READY, Ready(os.getpid(), self.name, 1.0)))
        self.last_beat = world.clock.now

    def end(self, kept: int) -> None:
        """The process dies: the first ``kept`` messages queued were in the buffer's socket already, the rest are
        lost, and so is what it had not read."""
        while len(self.outq) > kept:
            self.outq.pop()
        self.inq.clear()
        self.state = "down"
        self.thread = None
        if self.source is not None:
            self.source.close()
            self.source = None

    def stop(self) -> None:
        self.state = "stopped"
        self.stopped_at = self.world.clock.now

    def resume(self) -> None:
        self.state = "running"
        if self.world.clock.now - self.stopped_at > LINK_LOST_AFTER:
            self.link_lost()

    def link_lost(self) -> None:
        """The connection dropped what it held; the new one asks for a full snapshot (poller.link)."""
        self.outq.clear()
        self.inq.clear()
        if self.state == "running" and self.thread is not None:
            self.thread.request_resync()
            self.beat(force=True)

    # -- what it sends --------------------------------------------------------------------

    def _queue(self, kind: Kind, body: bytes) -> Frames:
        self.seq += 1
        message = Frames([encode_header(kind, self.epoch, self.seq), body], kind)
        self.outq.append(message)
        return message

    def _hand_over(self, kind: Kind, body: bytes, starts_snapshot: bool, stopping: Any) -> bool:
        self._queue(kind, body)
        if starts_snapshot:
            self.snapshot_seq = self.seq
        return True

    def poll(self) -> bool:
        """One poll now, on the store as it is; False when the process cannot (stopped, down)."""
        if self.state != "running" or self.thread is None:
            return False
        thread = self.thread
        truth = self.world.store.truth()
        full = thread.claim_requests(self.next_full)
        errors, polls, queued = thread.source_errors, thread.polls, len(self.outq)
        step = thread.poll(full)
        sent = list(self.outq)[queued:]
        if thread.source_errors > errors:
            failed = [decode(m.frames).body for m in sent if m.kind is Kind.ERROR]
            text = "; ".join(f"{e.type}: {e.message}" for e in failed if isinstance(e, Error))
            self.world.violation(f"d:source-error:{text.split(':')[0]}", f"{self.name}: the source failed: {text}")
        if step is None:
            self.end(len(self.outq))  # a fatal error ends the process (it said so)
            return True
        self.next_full = step[0]
        deltas = [m for m in sent if m.kind is Kind.DELTA]
        if deltas:
            if thread.polls > polls:  # a listing: what the store holds readably now
                self.last_listing = {name: canonical(tags) for name, tags in truth.readable.items()}
            deltas[-1].listing = dict(self.last_listing)  # (else the last poll sent again)
        return True

    def beat(self, force: bool = False) -> None:
        now = self.world.clock.now
        thread = self.thread
        if self.state != "running" or thread is None or (not force and now - self.last_beat < HEARTBEAT_S):
            return
        self.last_beat = now
        quarantine = thread.quarantine
        self._queue(Kind.HEARTBEAT, encode_body(Kind.HEARTBEAT, Heartbeat(
            polls=thread.polls, source_errors=thread.source_errors, rss=0, stalled_s=0.0, source_stalls=0,
            last_seq=self.seq, quarantined=len(quarantine.keys), quarantined_keys=quarantine.names(), listings=0,
            listing_s=0.0, listing_total_s=0.0, listing_share=0.0, watch_reads=0, watch_listings=0)))

    def control(self) -> bool:
        """Read what the buffer sent (as the control loop does); False when there was nothing or it cannot."""
        if self.state != "running" or self.thread is None or not self.inq:
            return False
        while self.inq:
            send = self.inq.popleft()
            body = send.body
            if isinstance(body, Sync):
                self.thread.request_sync(body.token, body.partitions, bool(body.mark))
            elif isinstance(body, Resync):
                if not resync_answered(body, send.epoch, self.epoch, self.snapshot_seq):
                    self.thread.request_resync()
        return True


class _Receiver:
    """What :class:`~buffer.sync.ListingSync` asks of the receiver, over the simulated network."""

    def __init__(self, world: World) -> None:
        self._world = world
        self.table = world.table

    def streaming(self) -> list[str]:
        return [peer.stream for peer in self.table.peers.values()
                if peer.bye_seq is None and not peer.stale and peer.epoch is not None]

    def peer_info(self, peer: str) -> Peer | None:
        return self.table.peers.get(peer.encode())

    def send_sync(self, peer: str, token: int) -> None:
        self._world.route([self.table.sync(peer.encode(), token, self._world.clock.now)])

    def send_watch(self, peer: str, partition: str, keys: list[str], seconds: float, every: float) -> None:
        pass  # no source here watches (a change feed is never watched)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _PendingSync:
    request: SyncRequest
    step: int


@dataclass
class _Removal:
    """The versions of a name the trainer removed (every write makes a new one: these are never shown again)."""

    versions: set[str] = field(default_factory=set)
    step: int = 0
    # A backup restored the store to one of these versions: a new history, in which that version may be shown
    # again (or stay hidden): from then on neither is wrong.
    restored: bool = False


# -- the world ---------------------------------------------------------------------------------------------------

class World:
    """One run: the store, the pollers, the trainer's buffer, and what the oracle remembers."""

    def __init__(self, config: Config, directory: str) -> None:
        self.config = config
        self.step = 0
        self.clock = Clock()
        self.epochs = 0
        self.store = Store(directory)
        self.buffer = PartitionStore(clock=self.clock)
        self.buffer.bound_age(MAX_VIEW_AGE)
        own_name = "own" if config.own is not None else None
        self.table = PeerTable(self.buffer, stale_after=STALE_AFTER,
                               pinned=frozenset({b"own"}) if own_name else frozenset())
        self.listings = ListingSync(self.buffer, _Receiver(self), own_name)
        self.buffer.on_removed = lambda token: self.route(self.table.marks(token, self.clock.now))
        self.sampler = StepSampler(SamplingAccess(self.buffer, self.listings))
        self.pollers: dict[str, SimPoller] = {}
        if config.own is not None:
            self.buffer.require("own")
            self.pollers["own"] = SimPoller(self, "own", config.own, own=True)
        for i, kind in enumerate(config.standalone):
            name = f"solo{i}"
            self.pollers[name] = SimPoller(self, name, kind, own=False)
        for poller in self.pollers.values():
            poller.start()
        # The oracle's memory.
        self.written: dict[Name, int] = {}  # name -> the step it was last written at
        self.removed: dict[Name, _Removal] = {}
        self.removal_steps: list[int] = []
        self.models: dict[str, dict[Name, str]] = {name: {} for name in self.pollers}  # what each stream lists
        self.applied_at: dict[str, list[int]] = {}  # stream -> the steps its last two complete polls were applied
        self.heard: dict[str, float] = {}  # stream -> when the buffer last received a message of it
        self.syncs: list[_PendingSync] = []
        self.violations: list[Violation] = []
        self.counts: dict[str, int] = {}
        self.protocol_errors = 0
        self.answered_syncs = 0
        self.decisions = 0

    def close(self) -> None:
        for poller in self.pollers.values():
            poller.end(0)
        self.store.close()

    def violation(self, kind: str, text: str) -> None:
        self.violations.append(Violation(kind, f"step {self.step}: {text}"))

    # -- carrying out one operation -------------------------------------------------------

    def do(self, op: Op) -> bool:
        """Carry out ``op``; False (and nothing done) when it does not apply now. Then check the oracle."""
        self.step += 1
        done = getattr(self, "_op_" + op[0])(*op[1:])
        if done is not False:
            self.counts[op[0]] = self.counts.get(op[0], 0) + 1
            self.check()
        return done is not False

    def _write(self, names: Iterable[Name], call: Callable[[], Any]) -> None:
        names = list(names)
        try:
            call()
        except ToolRefused:
            return  # nothing was written
        except Exception as exc:  # the store's own writers must keep working, whatever another tool did
            self.violation("d:api-write", f"a write through the store's API failed: {type(exc).__name__}: {exc}")
        for name in names:
            self.written[name] = self.step

    def _op_put(self, partition: str, keys: tuple[str, ...], status: str, step: int) -> None:
        truth = self.store.truth()
        names = [(partition, k) for k in keys]
        try:
            self.store.api.kv_batch_put(list(keys), partition, tags=[self.store.tags(status, step) for _ in keys])
        except ValueError as exc:
            if not any(truth.blocks(*name) for name in names):
                self.violation("d:api-refused", f"a put through the store's API failed: {exc}")
            return  # tags another tool wrote that cannot be read are not merged into: refused whole
        except Exception as exc:  # the store's own writers must keep working, whatever another tool did
            self.violation("d:api-write", f"a put through the store's API failed: {type(exc).__name__}: {exc}")
        self._write(names, lambda: None)

    def _op_clear(self, partition: str, keys: tuple[str, ...]) -> None:
        self._write([(partition, k) for k in keys], lambda: self.store.api.kv_clear(list(keys), partition))

    def _op_tool_set(self, partition: str, key: str, status: str, step: int, fewer: bool) -> bool:
        """Another tool rewrites a row's tags whole (``fewer``: without ``global_steps``)."""
        if (partition, key) not in self.store.truth().readable:
            return False
        tags = self.store.tags(status, step)
        if fewer:
            del tags["global_steps"]
        self._write([(partition, key)], lambda: self.store.tool(
            ("UPDATE kv SET tags = ? WHERE partition_id = ? AND key = ?", (json.dumps(tags), partition, key))))
        return True

    def _op_tool_reput(self, partition: str, key: str) -> bool:
        """Another tool clears a row and puts it back with the same tags, in one transaction."""
        tags = self.store.truth().readable.get((partition, key))
        if tags is None:
            return False
        self._write([(partition, key)], lambda: self.store.tool(
            ("DELETE FROM kv WHERE partition_id = ? AND key = ?", (partition, key)),
            ("INSERT INTO kv (partition_id, key, tags) VALUES (?, ?, ?)", (partition, key, json.dumps(tags)))))
        return True

    def _op_tool_rename(self, partition: str, key: str, to_partition: str, to_key: str) -> bool:
        """Another tool renames a row (its key, its partition or both) with an UPDATE."""
        truth = self.store.truth().readable
        if (partition, key) not in truth or (to_partition, to_key) in truth or (partition, key) == (to_partition,
                                                                                                     to_key):
            return False
        if any(name[0] == to_partition and name[1] == to_key for name in self._unreadable_names()):
            return False
        self._write([(partition, key), (to_partition, to_key)], lambda: self.store.tool(
            ("UPDATE kv SET partition_id = ?, key = ? WHERE partition_id = ? AND key = ?",
             (to_partition, to_key, partition, key))))
        return True

    def _unreadable_names(self) -> Iterator[Name]:
        for _, partition, _, key in self.store.truth().unreadable:
            yield partition.decode(errors="replace"), key.decode(errors="replace")

    def _op_tool_poison(self, partition: str, key: str, kind: str) -> None:
        self._write([(partition, key)], lambda: self.store.poison(partition, key, kind))

    def _op_tool_unpoison(self, partition: str, key: str) -> bool:
        """The tool deletes its unreadable rows of ``key`` (text and BLOB names alike)."""
        if (partition, key) not in set(self._unreadable_names()):
            return False
        self._write([(partition, key)], lambda: self.store.tool(
            ("DELETE FROM kv WHERE CAST(partition_id AS BLOB) = ? AND CAST(key AS BLOB) = ?",
             (partition.encode(), key.encode()))))
        return True

    def _op_tool_log(self, edit: str) -> None:
        try:
            self.store.edit_log(edit)
        except ToolRefused:
            return
        except sqlite3.Error as exc:
            self.violation("d:tool-failed", f"another tool could not {edit} the change log: {exc}")

    def _op_backup(self) -> None:
        self.store.backup()

    def _op_restore(self) -> bool:
        if not self.store.has_backup:
            return False
        before = self.store.truth().readable
        self._write([], self.store.restore)
        after = self.store.truth().readable
        for name in set(before) | set(after):
            self.written[name] = self.step
            removal = self.removed.get(name)
            if removal is not None and name in after and canonical(after[name]) in removal.versions:
                removal.restored = True
        return True

    def _poller(self, name: str) -> SimPoller | None:
        return self.pollers.get(name)

    def _op_poll(self, name: str) -> bool:
        poller = self._poller(name)
        return poller is not None and poller.poll()

    def _op_control(self, name: str) -> bool:
        poller = self._poller(name)
        return poller is not None and poller.control()

    def _op_deliver(self, name: str, count: int) -> bool:
        poller = self._poller(name)
        if poller is None or not poller.outq or poller.state == "stopped":
            return False
        for _ in range(count):
            if not poller.outq:
                break
            self._receive(poller, poller.outq.popleft())
        return True

    def _op_lose(self, name: str) -> bool:
        """One message lost on the way (the sequence shows the gap)."""
        poller = self._poller(name)
        if poller is None or not poller.outq:
            return False
        poller.outq.popleft()
        return True

    def _op_cut(self, name: str) -> bool:
        """The link drops what it holds both ways; the poller dials again and asks for a snapshot."""
        poller = self._poller(name)
        if poller is None or poller.state == "down":
            return False
        poller.link_lost()
        return True

    def _op_stop(self, name: str) -> bool:
        poller = self._poller(name)
        if poller is None or poller.state != "running":
            return False
        poller.stop()
        return True

    def _op_resume(self, name: str) -> bool:
        poller = self._poller(name)
        if poller is None or poller.state != "stopped":
            return False
        poller.resume()
        return True

    def _op_kill(self, name: str, kept: int) -> bool:
        poller = self._poller(name)
        if poller is None or poller.state == "down":
            return False
        poller.end(kept)
        return True

    def _op_start(self, name: str) -> bool:
        """A process starts: the buffer's supervisor restarts its own poller; an operator a standalone one."""
        poller = self._poller(name)
        if poller is None or poller.state != "down":
            return False
        poller.restarts += 1
        poller.start()
        return True

    def _op_advance(self, seconds: float) -> None:
        self.clock.now += seconds
        for poller in self.pollers.values():
            poller.beat()
        self.route(self.table.tick(self.clock.now))

    def _op_add(self, partition: str, key: str, mark: int) -> bool:
        if (partition, key) not in self._view():
            return False
        self.buffer.add(partition, {key: {"mark": mark}})
        return True

    def _op_remove(self, partition: str, keys: tuple[str, ...]) -> None:
        view = self._view()
        for key in keys:
            name = (partition, key)
            removal = self.removed.setdefault(name, _Removal())
            removal.step = self.step
            if name in view:
                removal.versions.add(view[name])
            removal.versions.update(model[name] for model in self.models.values() if name in model)
            self.removal_steps.append(self.step)
        self.buffer.remove(partition, list(keys))

    def _op_sync(self) -> None:
        self.syncs.append(_PendingSync(self.listings.begin(), self.step))

    def _op_sample(self, partition: str, step: int) -> None:
        try:
            batch = self.sampler.sample(partition, global_steps=step, timeout=0)
        except TimeoutError:
            return
        self.decisions += 1
        view = self.buffer.snapshot(partition)
        for key, tags in zip(batch.keys, batch.tags):
            if view.get(key) != tags or tags.get("status") != "success" or tags.get("global_steps") != step:
                self.violation("c:sample-handed-out", f"sample({partition!r}, {step}) handed out {key!r} {tags}; "
                                                      f"the view holds {view.get(key)}")
        running = [k for k, t in view.items() if t.get("status") == "running" and t.get("global_steps") == step]
        if running:
            self.violation("c:sample-while-running",
                           f"sample({partition!r}, {step}) answered while {running} of its step run")

    # -- the network ----------------------------------------------------------------------

    def route(self, actions: Iterable[Send]) -> None:
        """The buffer's messages to its pollers: queued for a live process, lost for a dead one."""
        for action in actions:
            poller = self.pollers.get(action.identity.decode())
            if poller is not None and poller.state != "down":
                poller.inq.append(action)

    def _receive(self, poller: SimPoller, message: Frames) -> None:
        peer = self.table.peers.get(poller.identity)
        applied = peer.polls_applied if peer is not None else 0
        errors = self.table.protocol_errors
        try:
            actions = self.table.on_frames(poller.identity, message.frames, self.clock.now)
        except ProtocolError as exc:  # never escapes the table: a bug if it does
            self.violation("d:receiver-raised", f"the receiver raised {exc!r}")
            return
        self.heard[poller.name] = self.clock.now
        if self.table.protocol_errors > errors:
            self.violation("d:protocol-error", f"{poller.name}'s message was refused by the receiver (protocol error)")
        self.route(actions)
        peer = self.table.peers.get(poller.identity)
        if message.listing is not None and peer is not None and peer.polls_applied > applied:
            self.models[poller.name] = message.listing
            self.applied_at[poller.name] = [*self.applied_at.get(poller.name, [0, 0])[1:], self.step]

    # -- the oracle -----------------------------------------------------------------------

    def _view(self) -> dict[Name, str]:
        """The buffer's view as canonical tags, the trainer's own ``mark`` aside."""
        view = {}
        for partition, items in self.buffer.snapshot().items():
            for key, tags in items.items():
                view[(partition, key)] = canonical({n: v for n, v in tags.items() if n != "mark"})
        return view

    def _silent(self, stream: str) -> bool:
        poller = self.pollers[stream]
        heard = self.heard.get(stream)
        return poller.state != "running" and (heard is None or self.clock.now - heard > STALE_AFTER)

    def _gone(self, stream: str) -> bool:
        heard = self.heard.get(stream)
        return (self.pollers[stream].state != "running"
                and (heard is None or self.clock.now - heard > MAX_VIEW_AGE + HEARTBEAT_S))

    def check(self) -> None:
        self._answer_syncs()
        view = self._view()
        for name, tags in view.items():
            removal = self.removed.get(name)
            if removal is not None and tags in removal.versions and not removal.restored:
                self.violation("b:removed-shown",
                               f"{name} shows {tags}, a version the trainer removed at step {removal.step}")
        self._check_fresh(view)
        self._check_memory()

    def _answer_syncs(self) -> None:
        for pending in list(self.syncs):
            if not pending.request.attempt():
                continue
            self.syncs.remove(pending)
            self.listings.answered(pending.request)
            self.answered_syncs += 1
            if pending.request.asked:  # a buffer no poller streams to has nothing to read back
                self._check_read_your_writes(pending.step)

    def _check_read_your_writes(self, began: int) -> None:
        truth = self.store.truth()
        view = self._view()
        expected = {name: canonical(tags) for name, tags in truth.readable.items()}
        for name in set(expected) | set(view):
            if self.written.get(name, -1) >= began:
                continue  # written since the call began: either is right
            removal = self.removed.get(name)
            if removal is not None and removal.step >= began:
                continue  # removed since the call began
            want = expected.get(name)
            if want is not None and removal is not None and want in removal.versions:
                if removal.restored:
                    continue  # a backup brought a removed version back: shown or hidden, both are right
                want = None  # a removed version stays hidden while listed
            if view.get(name) != want:
                kind = ("a:hidden" + ("-removed" if removal else "") if name not in view
                        else "a:shown-gone" if want is None else "a:wrong-tags")
                self.violation(kind, f"sync() that began at step {began} returned with {name} "
                                    f"{'absent' if name not in view else view[name]}; the store holds "
                                    f"{'nothing readable' if name not in expected else expected[name]}"
                                    + (f" (removed at step {removal.step}: {sorted(removal.versions)})"
                                       if removal else ""))

    def _check_fresh(self, view: dict[Name, str]) -> None:
        for partition in {name[0] for name in view}:
            if self.buffer.view_gap(partition) is not None or self.buffer.view_stale(partition) is not None:
                continue
            for name in view:
                if name[0] != partition:
                    continue
                vouchers = [stream for stream, model in self.models.items() if name in model]
                if vouchers and all(self._silent(stream) for stream in vouchers):
                    self.violation("c:fresh-with-silent", f"the view of {partition!r} is called fresh while it holds "
                                                          f"{name}, which only silent or gone pollers {vouchers} list")
                    return

    def _check_memory(self) -> None:
        ledger = self.buffer.ledger  # its private state: what it holds is what this checks
        tombs = [tomb for part in ledger._tombs.values() for tomb in part.values()]
        listed = sum(len(keys) for parts in ledger._listed.values() for keys in parts.values())
        # A poll under way at a removal may list the key: its tombstone waits for the poll after (two applied).
        # The buffer's own poller is waited for while down too (its supervisor restarts it), a standalone one until
        # withdrawn (silent past max_view_age).
        live = [self.applied_at.get(stream, [0, 0])[0] for stream in self.pollers
                if stream == "own" or not self._gone(stream)]
        recent = sum(1 for step in self.removal_steps if step > min(live)) if live else 0
        bound = self.buffer.key_count() + listed + recent + 8
        if len(tombs) > bound:
            held = self.buffer.key_count()
            self.violation("e:tombstones", f"{len(tombs)} tombstones, more than the {held} keys held, the {listed} "
                                           f"the streams list and the {recent} recent removals allow")
        widest = max((len(t.versions) for t in tombs), default=0)
        if widest > MAX_TOMB_VERSIONS:
            self.violation("e:tomb-versions", f"a tombstone holds {widest} removed versions")
        if len(self.table.peers) > len(self.pollers):
            self.violation("e:peers", f"{len(self.table.peers)} peers for {len(self.pollers)} pollers")

    # -- settling -------------------------------------------------------------------------

    def settle(self) -> list[Op]:
        """The operations that bring every poller back and the view to the store: a last ``sync()`` answered."""
        ops: list[Op] = []
        for name, poller in self.pollers.items():
            if poller.state == "stopped":
                ops.append(("resume", name))
            elif poller.state == "down":
                ops.append(("start", name))
        rounds: list[Op] = []
        for _ in range(3):
            rounds.append(("advance", 0.5))
            for name in self.pollers:
                rounds += [("control", name), ("poll", name), ("deliver", name, 1000), ("control", name)]
        return ops + rounds + [("sync",)] + rounds + rounds


def quiet_logs() -> None:
    """The product logs every resync and quarantine; a simulation makes thousands."""
    for name in ("buffer", "poller"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
