"""The SQLite store's change feed and the poller reading it: real SQLite files, real processes."""

from __future__ import annotations

import multiprocessing
import os
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from buffer import ReplayBuffer
from poller.diff import Sent
from poller.faults.store import backup as store_backup
from poller.faults.store import delete, restore
from poller.polling import PollingThread
from poller.reader import ListingReader
from poller.sources.contract import ChangeFeed, capabilities
from poller.sources.sqlite import SqliteSource
from poller.wire.protocol import Kind
from tests.conftest import wait_until
from tests.helpers.deltas import Polled, held_tags, packed_sent, polled, read
from tests.helpers.processes import run_to_the_end
from tests.helpers.sqlite_writers import open_and_put, random_ops, random_writer

SQLITE = "poller.sources.sqlite:SqliteSource"
JOIN_TIMEOUT = 60.0
CONVERGE_TIMEOUT = 60.0

_OLD_SCHEMA = ("CREATE TABLE kv (partition_id TEXT NOT NULL, key TEXT NOT NULL, tags TEXT NOT NULL,"
               " PRIMARY KEY (partition_id, key)) WITHOUT ROWID")


def _set_keep(path: Path | str, keep: int) -> None:
    """Shrink the deletion log's window (a setting kept in the file)."""
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.execute("UPDATE kv_clock SET keep = ?", (keep,))
    finally:
        conn.close()


def _served(changes: Any) -> Any:
    """A kv_changes() answer with its cursor's stamp left out (it is random)."""
    assert changes is not None
    (store_id, version, stamp), upserts, deletes = changes
    assert isinstance(stamp, int)
    return (store_id, version), upserts, deletes


def _non_empty(listing: dict[str, Any]) -> dict[str, Any]:
    return {partition: items for partition, items in listing.items() if items}


# -- the store's side ----------------------------------------------------------------------------------------

def test_the_sqlite_store_offers_a_change_feed(db: Path) -> None:
    with SqliteSource(db) as store:
        assert capabilities(store).change_feed and isinstance(store, ChangeFeed)


def test_changes_since_a_cursor(db: Path) -> None:
    with SqliteSource(db) as store:
        store.kv_put("a", "p", tag={"v": 1})
        cursor, listing = store.kv_snapshot()
        assert listing == {"p": {"a": {"v": 1}}}
        assert store.kv_changes(cursor) == (cursor, {}, {})
        store.kv_batch_put(["b", "c"], "p", tags=[{"v": 2}, {"v": 3}])
        store.kv_put("a", "q", tag={"w": 1})
        cursor, upserts, deletes = store.kv_changes(cursor)  # type: ignore[misc]
        assert upserts == {"p": {"b": {"v": 2}, "c": {"v": 3}}, "q": {"a": {"w": 1}}} and deletes == {}
        store.kv_put("b", "p", tag={"v": 2})  # tags as they were: no change
        assert store.kv_changes(cursor) == (cursor, {}, {})
        store.kv_clear(["b", "missing"], "p")
        cursor, upserts, deletes = store.kv_changes(cursor)  # type: ignore[misc]
        assert upserts == {} and deletes == {"p": ["b"]}
        store.kv_clear(["c"], "p")
        store.kv_put("c", "p", tag={"again": True})  # deleted, then put again: an upsert
        _, upserts, deletes = store.kv_changes(cursor)  # type: ignore[misc]
        assert upserts == {"p": {"c": {"again": True}}} and deletes == {}


def test_a_cursor_from_elsewhere_is_refused_or_sent_to_a_full_listing(db: Path, tmp_path: Path) -> None:
    with SqliteSource(db) as store, SqliteSource(tmp_path / "other.db") as other:
        cursor, _ = other.kv_snapshot()
        assert store.kv_changes(cursor) is None  # another file
        own, _ = store.kv_snapshot()
        assert store.kv_changes((own[0], own[1] + 5, own[2])) is None  # ahead of this file
        assert store.kv_changes((own[0], own[1], own[2] ^ 1)) is None  # another history of this file
        for bad in (None, "x", (own[0], own[1]), (own[0], True, 0), (own[0], 0, None), [*own]):
            with pytest.raises(TypeError, match="not a change cursor"):
                store.kv_changes(bad)


def test_a_cursor_older_than_the_pruned_log_gets_none(db: Path) -> None:
    with SqliteSource(db) as store:
        store.kv_put("keep", "p", tag={})
        _set_keep(db, 32)
        old, _ = store.kv_snapshot()
        for i in range(40):
            store.kv_put(f"k{i}", "p", tag={"i": i})
            store.kv_clear([f"k{i}"], "p")
        assert store.kv_changes(old) is None
        recent, listing = store.kv_snapshot()
        assert listing == {"p": {"keep": {}}}
        store.kv_clear(["keep"], "p")
        assert _served(store.kv_changes(recent)) == ((recent[0], recent[1] + 1), {}, {"p": ["keep"]})
        conn = sqlite3.connect(db)
        try:
            logged = conn.execute("SELECT count(*) FROM kv_deleted").fetchone()[0]
        finally:
            conn.close()
        assert logged <= 32 + 32 // 16 + 1  # pruned, not grown with every delete


def test_an_old_schema_file_is_migrated_in_place_by_concurrent_openers(db: Path) -> None:
    conn = sqlite3.connect(db)
    with conn:
        conn.execute(_OLD_SCHEMA)
        conn.execute("INSERT INTO kv VALUES ('p', 'old', '{\"v\": 1}')")
    conn.close()
    ctx = multiprocessing.get_context("spawn")
    gate = ctx.Event()
    procs = [ctx.Process(target=open_and_put, args=(str(db), n, gate)) for n in range(3)]
    assert run_to_the_end(procs, JOIN_TIMEOUT, started=gate.set) == [0, 0, 0]
    with SqliteSource(db) as store:
        cursor, listing = store.kv_snapshot()
        assert listing == {"p": {"old": {"v": 1}, **{f"new{n}": {"index": n} for n in range(3)}}}
        assert cursor[1] == 3  # the three puts after the migration, one version each
        store.kv_put("old", "p", tag={"v": 2})
        assert _served(store.kv_changes(cursor)) == ((cursor[0], 4), {"p": {"old": {"v": 2}}}, {})


def test_a_deleted_or_replaced_file_sends_the_feed_to_a_full_listing(db: Path, tmp_path: Path) -> None:
    reader = SqliteSource(db)
    try:
        with SqliteSource(db) as writer:
            writer.kv_put("old", "p", tag={})
        cursor, _ = reader.kv_snapshot()
        delete(str(db))
        with pytest.raises(FileNotFoundError, match="deleted while open"):
            reader.kv_changes(cursor)
        assert reader.kv_changes(cursor) is None  # a new, empty file: another store
        other = str(tmp_path / "other.db")
        with SqliteSource(other) as writer:
            writer.kv_put("restored", "p", tag={})
        cursor, _ = reader.kv_snapshot()
        delete(str(db))
        os.rename(other, db)
        assert reader.kv_changes(cursor) is None
        assert reader.kv_snapshot()[1] == {"p": {"restored": {}}}
    finally:
        reader.close()


# -- the poller's side ---------------------------------------------------------------------------------------

class _ListingOnly:
    """The same store seen without its change feed: the poller lists it in full on every poll."""

    def __init__(self, store: SqliteSource) -> None:
        self._store = store

    def kv_list(self) -> Any:
        return self._store.kv_list()


@pytest.mark.parametrize("seed", range(4))
def test_the_change_feed_and_the_full_listing_send_the_same_content(db: Path, seed: int) -> None:
    rng = random.Random(seed)
    with _CountingSqliteSource(db) as store:
        store.kv_list()  # creates the file
        _set_keep(db, 64)  # small enough that some bursts outrun the log: the fallback is exercised too
        feed, listed = ListingReader(store), ListingReader(_ListingOnly(store))
        assert feed.feed and not listed.feed
        sent_feed: Sent = {}
        sent_listed: Sent = {}
        for poll in range(60):
            full = poll == 0 or rng.random() < 0.05
            for reader, sent in ((feed, sent_feed), (listed, sent_listed)):
                read(reader, sent, full, commit=True)
            assert held_tags(sent_feed) == held_tags(sent_listed) == store.kv_list(), f"poll {poll}"
            random_ops(store, rng, rng.choice([0, 1, 3, 10, 10, 80]))
        assert store.calls["kv_changes"] > 30 and store.unservable > 0


def test_a_change_read_that_was_not_committed_is_read_again(db: Path) -> None:
    with SqliteSource(db) as store:
        reader = ListingReader(store)
        sent: Sent = {}
        read(reader, sent, True, commit=True)
        store.kv_put("a", "p", tag={"v": 1})
        assert read(reader, sent, False).upserts == {"p": {"a": {"v": 1}}}
        # Not committed (say, the encoding failed): the next poll still has it.
        assert read(reader, sent, False, commit=True).upserts == {"p": {"a": {"v": 1}}}
        assert read(reader, sent, False).upserts == {}


def test_a_change_set_skips_what_was_sent_and_refuses_garbage() -> None:
    sent = packed_sent({"p": {"same": {"v": 1}, "gone": {}}})

    def diff_changes(upserts: Any, deletes: Any) -> Polled:
        return polled(sent, upserts, full=False, complete=False, deletes=deletes)

    diff = diff_changes({"p": {"same": {"v": 1}, "new": None}}, {"p": ["gone", "never-sent"], "q": ["x"]})
    assert diff.upserts == {"p": {"new": {}}} and diff.deletes == {"p": ["gone"]}
    for upserts, deletes, match in [({}, {"p": "k"}, "expected a list"), ({}, [], "expected a mapping")]:
        with pytest.raises(TypeError, match=match):
            diff_changes(upserts, deletes)
    # A delete of a name no stream carries was never sent: skipped (the poller's quarantine lets it go).
    diff = diff_changes({}, {"p": [b"gone", 1, ["x"], "gone"], b"p": ["gone"], 2: [b"k"]})
    assert diff.upserts == {} and diff.deletes == {"p": ["gone"]}
    # One bad record is refused alone (quarantined by the poller), not the change set.
    for upserts, reason in [({1: {"k": {}}}, "partition id 1 is int"), ({"p": {"k": 3}}, "tags are int")]:
        diff = diff_changes({**upserts, "p2": {"fine": {}}}, {})
        assert [r.reason for r in diff.refused] == [f"{reason}, not str" if "partition" in reason
                                                   else f"{reason}, not a mapping"]
        assert diff.upserts["p2"] == {"fine": {}}



# The change log as this package wrote it before versions were logged with stamps: one counter row,
# bumped by every write (a file from then, or a backup of one).
_CHANGE_LOG_BEFORE_STAMPS = (
    _OLD_SCHEMA,
    "ALTER TABLE kv ADD COLUMN version INTEGER NOT NULL DEFAULT 0",
    "CREATE TABLE kv_clock (id INTEGER PRIMARY KEY CHECK (id = 0), store_id TEXT NOT NULL,"
    " version INTEGER NOT NULL, pruned INTEGER NOT NULL, keep INTEGER NOT NULL)",
    "INSERT INTO kv_clock VALUES (0, lower(hex(randomblob(8))), 0, 0, 1000000)",
    "CREATE TABLE kv_deleted (partition_id TEXT NOT NULL, key TEXT NOT NULL, version INTEGER NOT NULL,"
    " PRIMARY KEY (partition_id, key)) WITHOUT ROWID",
    "CREATE INDEX kv_deleted_by_version ON kv_deleted (version)",
    "CREATE INDEX kv_by_version ON kv (version)",
    "CREATE TRIGGER kv_version_insert AFTER INSERT ON kv BEGIN UPDATE kv_clock SET version = version + 1;"
    " UPDATE kv SET version = (SELECT version FROM kv_clock) WHERE partition_id = NEW.partition_id"
    " AND key = NEW.key; DELETE FROM kv_deleted WHERE partition_id = NEW.partition_id AND key = NEW.key; END",
    "CREATE TRIGGER kv_version_update AFTER UPDATE OF tags ON kv WHEN OLD.tags IS NOT NEW.tags BEGIN"
    " UPDATE kv_clock SET version = version + 1; UPDATE kv SET version = (SELECT version FROM kv_clock)"
    " WHERE partition_id = NEW.partition_id AND key = NEW.key; END",
    "CREATE TRIGGER kv_version_delete AFTER DELETE ON kv BEGIN UPDATE kv_clock SET version = version + 1;"
    " INSERT OR REPLACE INTO kv_deleted (partition_id, key, version)"
    " VALUES (OLD.partition_id, OLD.key, (SELECT version FROM kv_clock)); END",
    "CREATE TRIGGER kv_deleted_prune AFTER INSERT ON kv_deleted WHEN NEW.version - (SELECT keep FROM kv_clock)"
    " > (SELECT pruned FROM kv_clock) + (SELECT keep FROM kv_clock) / 16 BEGIN"
    " UPDATE kv_clock SET pruned = NEW.version - keep;"
    " DELETE FROM kv_deleted WHERE version <= (SELECT pruned FROM kv_clock); END",
)


def _file_before_stamps(path: str) -> None:
    """A file with the change log before stamps, five versions written: a, b, c put, a changed, b cleared."""
    conn = sqlite3.connect(path)
    try:
        with conn:
            for statement in _CHANGE_LOG_BEFORE_STAMPS:
                conn.execute(statement)
            conn.executemany("INSERT INTO kv (partition_id, key, tags) VALUES ('p', ?, '{}')", [("a",), ("b",), ("c",)])
            conn.execute("UPDATE kv SET tags = '{\"v\": 1}' WHERE key = 'a'")
            conn.execute("DELETE FROM kv WHERE key = 'b'")
    finally:
        conn.close()


def _schema(path: str) -> list[tuple[str, str]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT name, sql FROM sqlite_master ORDER BY name").fetchall()
    finally:
        conn.close()


def test_a_file_with_the_change_log_before_stamps_is_migrated_once_and_its_versions_go_on(db: Path) -> None:
    _file_before_stamps(str(db))
    with SqliteSource(db) as store:
        cursor, listing = store.kv_snapshot()
        assert listing == {"p": {"a": {"v": 1}, "c": {}}} and cursor[1] == 5  # on from the old counter
        store.kv_put("d", "p", tag={})
        store.kv_clear(["c"], "p")
        assert _served(store.kv_changes(cursor)) == ((cursor[0], 7), {"p": {"d": {}}}, {"p": ["c"]})
    migrated = _schema(str(db))
    with SqliteSource(db) as store:  # a second opener finds nothing to do
        store.kv_put("e", "p", tag={})
    assert _schema(str(db)) == migrated
    # The old counter follows within 4096 versions: a reader of the version before stamps on the
    # same file re-reads at most that many changes and misses none.
    with SqliteSource(db) as store:
        store.kv_batch_put([f"k{i}" for i in range(5000)], "p")
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("SELECT version FROM kv_clock").fetchone()[0] == 4096
    finally:
        conn.close()


def test_a_backup_from_before_the_stamps_restored_in_place_is_migrated_at_the_next_read(db: Path,
                                                                                       tmp_path: Path) -> None:
    backup = str(tmp_path / "backup.db")
    _file_before_stamps(backup)
    restore(str(db), backup)
    with SqliteSource(db) as store:
        cursor, _ = store.kv_snapshot()
        store.kv_put("after", "p", tag={})
        restore(str(db), backup)  # the same inode, the old change log back
        store_id = cursor[0]
        assert store.kv_changes(cursor) is None  # another history: a full listing
        assert store.kv_snapshot() == ((store_id, 5, store.kv_snapshot()[0][2]), {"p": {"a": {"v": 1}, "c": {}}})
        assert "kv_versions" in dict(_schema(str(db)))["kv_version_insert"]

class _CountingSqliteSource(SqliteSource):
    """A real SQLite store that counts how the poller reads it."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.calls: dict[str, int] = {"kv_list": 0, "kv_snapshot": 0, "kv_changes": 0}
        self.unservable = 0  # kv_changes() calls answered None: the reader falls back to a full listing

    def kv_list(self, partition_id: str | None = None) -> Any:
        self.calls["kv_list"] += 1
        return super().kv_list(partition_id)

    def kv_snapshot(self) -> Any:
        self.calls["kv_snapshot"] += 1
        return super().kv_snapshot()

    def kv_snapshot_pieces(self, size: int = 4096) -> Any:
        self.calls["kv_snapshot"] += 1  # the same full listing, read in pieces
        return super().kv_snapshot_pieces(size)

    def kv_changes(self, cursor: Any) -> Any:
        self.calls["kv_changes"] += 1
        changes = super().kv_changes(cursor)
        self.unservable += changes is None
        return changes


def test_the_poller_lists_the_store_once_then_reads_only_changes(db: Path) -> None:
    # Before the change feed every poll called kv_list(): work in proportion to the store.
    source = _CountingSqliteSource(str(db))
    source.kv_batch_put([f"k{i}" for i in range(100)], "p")
    emitted: list[Kind] = []
    thread = PollingThread(source, lambda kind, body, *_: emitted.append(kind) is None, poll_interval=0.01)
    thread.start()
    try:
        assert wait_until(lambda: thread.polls >= 20, timeout=JOIN_TIMEOUT)
    finally:
        thread.stop()
        thread.join(JOIN_TIMEOUT)
        source.close()
    assert not thread.is_alive() and set(emitted) == {Kind.DELTA}
    assert source.calls["kv_list"] == 0
    assert source.calls["kv_snapshot"] == 1
    assert source.calls["kv_changes"] >= 19


# -- through a real ReplayBuffer -----------------------------------------------------------------------------

def _run_writers(db: Path, seeds: list[int], ops: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=random_writer, args=(str(db), seed, ops)) for seed in seeds]
    assert run_to_the_end(procs, JOIN_TIMEOUT) == [0] * len(procs)


def _converges(rb: ReplayBuffer, store: SqliteSource) -> bool:
    return wait_until(lambda: _non_empty(rb.snapshot()) == store.kv_list(), timeout=CONVERGE_TIMEOUT, interval=0.05)


def test_concurrent_writer_processes_through_a_replay_buffer(db: Path) -> None:
    with SqliteSource(db) as store:
        store.kv_put("seed", "train", tag={"s": 0})
        with ReplayBuffer(SQLITE, source_kwargs={"path": str(db)}, poll_interval=0.02) as rb:
            assert wait_until(lambda: rb.snapshot() == {"train": {"seed": {"s": 0}}}, timeout=CONVERGE_TIMEOUT)
            _run_writers(db, [11, 12, 13], 150)
            assert _converges(rb, store)
            _set_keep(db, 16)  # the next burst outruns the deletion log: the poller must take a full listing
            _run_writers(db, [21, 22], 200)
            assert _converges(rb, store)
            store.kv_clear(list(store.kv_list().get("train", {})), "train")
            assert _converges(rb, store)


def test_an_old_schema_file_and_a_replaced_file_through_a_replay_buffer(db: Path, tmp_path: Path) -> None:
    conn = sqlite3.connect(db)
    with conn:
        conn.execute(_OLD_SCHEMA)
        conn.execute("INSERT INTO kv VALUES ('p', 'old', '{}')")
    conn.close()
    other = str(tmp_path / "other.db")
    with ReplayBuffer(SQLITE, source_kwargs={"path": str(db)}, poll_interval=0.02) as rb:
        assert wait_until(lambda: rb.snapshot() == {"p": {"old": {}}}, timeout=CONVERGE_TIMEOUT)
        with SqliteSource(db) as store:
            store.kv_put("after", "p", tag={"v": 1})
        assert wait_until(lambda: rb.snapshot() == {"p": {"old": {}, "after": {"v": 1}}}, timeout=CONVERGE_TIMEOUT)
        with SqliteSource(other) as store:
            store.kv_put("restored", "p", tag={})
        delete(str(db))
        os.rename(other, db)
        assert wait_until(lambda: rb.snapshot() == {"p": {"restored": {}}}, timeout=CONVERGE_TIMEOUT)
        with SqliteSource(db) as store:
            store.kv_put("later", "p", tag={})
        assert wait_until(lambda: rb.snapshot() == {"p": {"restored": {}, "later": {}}}, timeout=CONVERGE_TIMEOUT)


def test_the_periodic_reconciliation_catches_a_change_the_feed_missed(db: Path) -> None:
    with SqliteSource(db) as store:
        store.kv_put("a", "p", tag={"v": 1})
    stores = {interval: _CountingSqliteSource(db) for interval in (3600.0, 0.0)}
    try:
        # No listing share: a reconciliation due is taken at once (the share's deferral: test_listing_share.py).
        readers = {interval: ListingReader(stores[interval], listing_share=1.0) for interval in stores}
        sent = {interval: {} for interval in readers}  # type: dict[float, Sent]
        for interval, reader in readers.items():
            reader.reconcile_interval = interval
            read(reader, sent[interval], True, commit=True)
        conn = sqlite3.connect(db)  # an edit the triggers do not see, by a tool that puts them back as they were
        try:
            with conn:
                trigger, = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'kv_version_update'").fetchone()
                conn.execute("DROP TRIGGER kv_version_update")
                conn.execute("UPDATE kv SET tags = '{\"v\": 2}' WHERE key = 'a'")
                conn.execute(trigger)
        finally:
            conn.close()
        assert read(readers[3600.0], sent[3600.0], False).upserts == {}
        assert read(readers[0.0], sent[0.0], False).upserts == {"p": {"a": {"v": 2}}}
        assert stores[0.0].calls["kv_snapshot"] == 2 and stores[3600.0].calls["kv_changes"] == 1
    finally:
        for counting in stores.values():
            counting.close()
    with SqliteSource(db) as store:  # the feed goes on
        cursor, _ = store.kv_snapshot()
        store.kv_put("a", "p", tag={"v": 3})
        assert _served(store.kv_changes(cursor)) == ((cursor[0], cursor[1] + 1), {"p": {"a": {"v": 3}}}, {})


def test_a_resync_with_a_change_feed_sends_what_was_sent_plus_the_changes_without_a_listing(db: Path) -> None:
    # A RESYNC means the receiver lost messages, not that the store changed behind the feed: what was
    # sent plus this poll's changes is the whole store, and a paused trainer costs the store no listing.
    source = _CountingSqliteSource(str(db))
    try:
        source.kv_batch_put([f"k{i}" for i in range(50)], "p", tags=[{"v": i} for i in range(50)])
        source.kv_put("x", "q", tag={"v": 0})
        reader = ListingReader(source)
        sent: Sent = {}
        read(reader, sent, True, commit=True)
        source.kv_put("k1", "p", tag={"v": 100})
        source.kv_clear(["k2"], "p")
        source.kv_clear(["x"], "q")
        source.kv_put("new", "r", tag={})
        held = sent["p"]["k3"]
        diff = read(reader, sent, True)
        assert diff.upserts == source.kv_list() and diff.deletes == {}
        # Unchanged keys are sent as the very bytes sent (not screened or packed again).
        assert diff.diff.packed["p"][1][diff.diff.packed["p"][0].index("k3")] is held
        diff.diff.commit(sent)
        reader.commit()
        assert held_tags(sent) == source.kv_list()
        assert source.calls["kv_snapshot"] == 1 and source.calls["kv_changes"] == 1
    finally:
        source.close()


@pytest.mark.parametrize("how", ["in-place", "by-rename"])
def test_a_restored_backup_is_noticed_although_its_counter_moved_past_the_cursor(db: Path, tmp_path: Path,
                                                                                  how: str) -> None:
    # A backup carries the store id. Before, once writers moved the restored file's version counter past the
    # poller's cursor, the cursor was served against the other history: after sync() the buffer missed the
    # restored file's new keys and still held keys it no longer had, until the 10-minute reconciliation.
    backup = str(tmp_path / "backup.db")
    with SqliteSource(db) as store:
        store.kv_batch_put(["k1", "k2", "k3"], "p", tags=[{"v": 1}] * 3)
        with ReplayBuffer(SQLITE, source_kwargs={"path": str(db)}, poll_interval=0.02) as rb:
            rb.sync(timeout=30)
            store_backup(str(db), backup)
            store.kv_batch_put(["x1", "x2", "x3"], "p", tags=[{"v": 1}] * 3)
            rb.sync(timeout=30)
            assert sorted(rb.snapshot("p")) == ["k1", "k2", "k3", "x1", "x2", "x3"]
            snapshots = rb.stats()["snapshots"]
            # The backup's history goes on elsewhere (as on the restored file, between two polls) past the cursor.
            with SqliteSource(backup) as restored:
                restored.kv_batch_put(["n1", "n2", "n3"], "p", tags=[{"v": 2}] * 3)
                restored.kv_put("k1", "p", tag={"v": 2})
            if how == "in-place":
                restore(str(db), backup)  # the same inode: what sqlite3's .restore does
            else:  # rm kv.db*; mv backup.db kv.db
                delete(str(db))
                os.rename(backup, db)
            rb.sync(timeout=30)
            assert rb.snapshot("p") == store.kv_list("p")["p"] == {
                "k1": {"v": 2}, "k2": {"v": 1}, "k3": {"v": 1}, "n1": {"v": 2}, "n2": {"v": 2}, "n3": {"v": 2}}
            # The full listing the restore took is counted as one (it was sent as a diff, and not counted).
            assert rb.stats()["snapshots"] == snapshots + 1
            store.kv_put("later", "p", tag={})
            rb.sync(timeout=30)
            assert "later" in rb.snapshot("p") and rb.stats()["restarts"] == 0


# -- renames by another tool ---------------------------------------------------------------------------------

def _tool(path: Path | str, *statements: str) -> None:
    """Another tool sharing the file: plain sqlite3, its statements in one transaction."""
    conn = sqlite3.connect(path)
    try:
        with conn:
            for statement in statements:
                conn.execute(statement)
    finally:
        conn.close()


# what another tool runs: (the statement, the upserts and the deletes the feed must give)
RENAMES = {
    "key": ("UPDATE kv SET key = 'a2' WHERE key = 'a'", {"p": {"a2": {"v": 1}}}, {"p": ["a"]}),
    "partition": ("UPDATE kv SET partition_id = 'q' WHERE key = 'a'", {"q": {"a": {"v": 1}}}, {"p": ["a"]}),
    "both-and-tags": ("UPDATE kv SET partition_id = 'q', key = 'a2', tags = '{\"v\": 9}' WHERE key = 'a'",
                      {"q": {"a2": {"v": 9}}}, {"p": ["a"]}),
    "onto-a-deleted-name": ("UPDATE kv SET key = 'gone' WHERE key = 'a'", {"p": {"gone": {"v": 1}}}, {"p": ["a"]}),
}


@pytest.mark.parametrize("created", ["now", "before-the-fix"])
@pytest.mark.parametrize("what", sorted(RENAMES))
def test_a_rename_by_another_tool_is_a_delete_of_the_old_name_and_an_upsert_of_the_new(db: Path, what: str,
                                                                                        created: str) -> None:
    # Before: the update trigger fired only on a change of the tags, so a renamed key or partition logged nothing:
    # kv_changes() gave neither the delete nor the new row, and the buffer served the old name until the
    # 10-minute reconciliation.
    statement, upserts, deletes = RENAMES[what]
    with SqliteSource(db) as store:
        store.kv_batch_put(["a", "b", "gone"], "p", tags=[{"v": 1}, {"v": 2}, {}])
        store.kv_clear(["gone"], "p")
    if created == "before-the-fix":  # a file whose change log has no trigger for renames
        _tool(db, "DROP TRIGGER IF EXISTS kv_version_rename")
    with SqliteSource(db) as store:
        cursor, _ = store.kv_snapshot()
        _tool(db, statement)
        changed = store.kv_changes(cursor)
        assert changed is not None
        _, got_upserts, got_deletes = changed
        assert (got_upserts, got_deletes) == (upserts, deletes)
        assert got_upserts == {p: {k: store.kv_list(p)[p][k] for k in items} for p, items in upserts.items()}


@pytest.mark.parametrize("what", ["key", "partition"])
def test_a_rename_by_another_tool_reaches_the_buffer_at_the_next_sync(db: Path, what: str) -> None:
    with SqliteSource(db) as store:
        store.kv_batch_put(["a", "b"], "p", tags=[{"v": 1}, {"v": 2}])
        with ReplayBuffer(SQLITE, source_kwargs={"path": str(db)}, poll_interval=0.05) as rb:
            rb.sync(timeout=30)
            assert rb.snapshot() == {"p": {"a": {"v": 1}, "b": {"v": 2}}}
            _tool(db, RENAMES[what][0])
            rb.sync(timeout=30)
            assert _non_empty(rb.snapshot()) == store.kv_list() == {
                "key": {"p": {"a2": {"v": 1}, "b": {"v": 2}}},
                "partition": {"p": {"b": {"v": 2}}, "q": {"a": {"v": 1}}}}[what]
            assert rb.stats()["restarts"] == 0 and rb.stats()["source_errors"] == 0


# -- the change log, emptied, dropped or trimmed by another tool ----------------------------------------------

# what another tool does to the file, as statements (each list one transaction; VACUUM runs alone)
LOG_DAMAGE = {
    "DELETE FROM kv_versions": ["DELETE FROM kv_versions"],
    "DROP TABLE kv_versions": ["DROP TABLE kv_versions"],
    "kv_versions trimmed by hand": ["DELETE FROM kv_versions WHERE version < (SELECT max(version) FROM kv_versions)"],
    # A clear by the tool in the same transaction: its delete is in the log the tool empties.
    "DELETE FROM kv_deleted": ["DELETE FROM kv WHERE key = 'b'", "DELETE FROM kv_deleted"],
    "kv_deleted trimmed by hand": ["DELETE FROM kv WHERE key = 'b'",
                                   "DELETE FROM kv_deleted WHERE version <= (SELECT max(version) FROM kv_deleted)"],
    "DROP TABLE kv_deleted": ["DELETE FROM kv WHERE key = 'b'", "DROP TABLE kv_deleted"],
    "DROP TABLE kv_clock": ["DROP TABLE kv_clock"],
    "DELETE FROM kv_clock": ["DELETE FROM kv_clock"],
    "everything": ["DELETE FROM kv WHERE key = 'b'", "DROP TABLE kv_versions", "DROP TABLE kv_deleted",
                   "DROP TABLE kv_clock"],
    # Its edit made while the trigger was missing: the repair cannot know what it missed, so it lists.
    "a trigger dropped, then a write": ["DROP TRIGGER kv_version_update",
                                        "UPDATE kv SET tags = '{\"v\": 20}' WHERE key = 'a'"],
    "VACUUM": ["VACUUM"],
}


@pytest.mark.parametrize("first", ["poller", "writer"], ids=["then-the-poller-reads", "then-the-writer-writes"])
@pytest.mark.parametrize("damage", sorted(LOG_DAMAGE))
def test_a_change_log_another_tool_emptied_or_dropped_costs_at_most_a_full_listing(db: Path, damage: str,
                                                                                   first: str) -> None:
    # Before: an emptied kv_versions made kv_snapshot() raise TypeError (no last version): source errors, then
    # PollerCrashed (~5 s). A dropped one failed every put of a writer already open until a poller re-created it
    # (kv_clock: every clear). An emptied kv_deleted lost the deletes since the cursor: the buffer kept the keys.
    with SqliteSource(db) as store:  # the store's own writer, open throughout
        store.kv_batch_put(["a", "b", "c"], "p", tags=[{"v": 1}, {"v": 2}, {"v": 3}])
        # The poller reads only when sync() asks (the interval is long): what it reads first is the test's to say.
        with ReplayBuffer(SQLITE, source_kwargs={"path": str(db)}, poll_interval=60.0) as rb:
            rb.sync(timeout=30)
            assert rb.snapshot() == store.kv_list()
            if damage == "VACUUM":
                conn = sqlite3.connect(db, isolation_level=None)
                try:
                    conn.execute("VACUUM")
                finally:
                    conn.close()
            else:
                _tool(db, *LOG_DAMAGE[damage])
            if first == "poller":
                rb.sync(timeout=30)
                assert _non_empty(rb.snapshot()) == store.kv_list()
            store.kv_batch_put(["c", "d"], "p", tags=[{"v": 30}, {"v": 4}])
            store.kv_clear(["a"], "p")
            rb.sync(timeout=30)
            assert _non_empty(rb.snapshot()) == store.kv_list()
            store.kv_put("e", "p", tag={"v": 5})
            store.kv_clear(["d"], "p")
            rb.sync(timeout=30)
            assert _non_empty(rb.snapshot()) == store.kv_list()
            assert sorted(store.kv_list()["p"]) == (["b"] if "'b'" not in " ".join(LOG_DAMAGE[damage]) else []) + [
                "c", "e"]
            stats = rb.stats()
            assert stats["restarts"] == 0 and stats["source_errors"] == 0 and stats["poller_alive"]


def test_an_emptied_version_log_is_seeded_where_the_file_left_off_and_old_cursors_get_none(db: Path) -> None:
    with SqliteSource(db) as store:
        store.kv_batch_put(["a", "b"], "p", tags=[{"v": 1}, {"v": 2}])
        store.kv_clear(["b"], "p")
        cursor, _ = store.kv_snapshot()
        _tool(db, "DELETE FROM kv_versions")
        assert store.kv_changes(cursor) is None  # it cannot tell what happened since: a full listing
        again, listing = store.kv_snapshot()
        assert listing == {"p": {"a": {"v": 1}}} and again[1] > cursor[1]  # versions go on, never back
        assert store.kv_changes(again) == (again, {}, {})
        _tool(db, "DELETE FROM kv_versions")
        # Another tool writes before any read (its write numbered from 1 again, below the rows' versions): the
        # next read finds the log behind them, and versions still go on from the highest one the file used.
        _tool(db, "UPDATE kv SET tags = '{\"v\": 9}' WHERE key = 'a'")
        assert store.kv_changes(again) is None
        last, listing = store.kv_snapshot()
        assert listing == {"p": {"a": {"v": 9}}} and last[1] > again[1]
        assert store.kv_changes(last) == (last, {}, {})  # the rows numbered low are not listed again and again
        # The same with no deletion logged: the horizon the last mend set still tells that the log is behind.
        _tool(db, "DELETE FROM kv_deleted", "DELETE FROM kv_versions", "UPDATE kv SET tags = '{}' WHERE key = 'a'")
        assert store.kv_changes(last) is None
        latest, listing = store.kv_snapshot()
        assert listing == {"p": {"a": {}}} and latest[1] > last[1]
        assert store.kv_changes(latest) == (latest, {}, {})  # served: not a full listing at every poll
        store.kv_put("c", "p", tag={})
        assert _served(store.kv_changes(latest)) == ((latest[0], latest[1] + 1), {"p": {"c": {}}}, {})
