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
from poller.changes import ListingReader, diff_changes
from poller.faults.store import delete
from poller.polling import Listing, PollingThread, commit_listing
from poller.protocol import Kind
from poller.sources import ChangeFeed, has_change_feed
from poller.sources.sqlite import SqliteSource
from tests.conftest import wait_until
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


def _non_empty(listing: dict[str, Any]) -> dict[str, Any]:
    return {partition: items for partition, items in listing.items() if items}


# -- the store's side ----------------------------------------------------------------------------------------

def test_the_sqlite_store_offers_a_change_feed(db: Path) -> None:
    with SqliteSource(db) as store:
        assert has_change_feed(store) and isinstance(store, ChangeFeed)


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
        assert store.kv_changes((own[0], own[1] + 5)) is None  # ahead of this file
        for bad in (None, "x", (own[0],), (own[0], True), [own[0], 0]):
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
        assert store.kv_changes(recent) == ((recent[0], recent[1] + 1), {}, {"p": ["keep"]})
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
    try:
        for proc in procs:
            proc.start()
        gate.set()
        for proc in procs:
            proc.join(JOIN_TIMEOUT)
        assert [proc.exitcode for proc in procs] == [0, 0, 0]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT)
            proc.close()
    with SqliteSource(db) as store:
        cursor, listing = store.kv_snapshot()
        assert listing == {"p": {"old": {"v": 1}, **{f"new{n}": {"index": n} for n in range(3)}}}
        assert cursor[1] == 3  # the three puts after the migration, one version each
        store.kv_put("old", "p", tag={"v": 2})
        assert store.kv_changes(cursor) == ((cursor[0], 4), {"p": {"old": {"v": 2}}}, {})


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
        sent_feed: Listing = {}
        sent_listed: Listing = {}
        for poll in range(60):
            full = poll == 0 or rng.random() < 0.05
            for reader, sent in ((feed, sent_feed), (listed, sent_listed)):
                diff = reader.read(sent, full)
                commit_listing(sent, diff, full)
                reader.commit()
            assert sent_feed == sent_listed == store.kv_list(), f"poll {poll}"
            random_ops(store, rng, rng.choice([0, 1, 3, 10, 10, 80]))
        assert store.calls["kv_changes"] > 30 and store.unservable > 0


def test_a_change_read_that_was_not_committed_is_read_again(db: Path) -> None:
    with SqliteSource(db) as store:
        reader = ListingReader(store)
        sent: Listing = {}
        commit_listing(sent, reader.read(sent, True), True)
        reader.commit()
        store.kv_put("a", "p", tag={"v": 1})
        assert reader.read(sent, False).upserts == {"p": {"a": {"v": 1}}}
        # Not committed (say, the encoding failed): the next poll still has it.
        diff = reader.read(sent, False)
        assert diff.upserts == {"p": {"a": {"v": 1}}}
        commit_listing(sent, diff, False)
        reader.commit()
        assert reader.read(sent, False).upserts == {}


def test_diff_changes_skips_what_was_sent_and_refuses_garbage() -> None:
    sent: Listing = {"p": {"same": {"v": 1}, "gone": {}}}
    diff = diff_changes(sent, {"p": {"same": {"v": 1}, "new": None}}, {"p": ["gone", "never-sent"], "q": ["x"]})
    assert diff.upserts == {"p": {"new": {}}} and diff.deletes == {"p": ["gone"]}
    for upserts, deletes, match in [({}, {"p": "k"}, "expected a list"), ({}, [], "expected a mapping")]:
        with pytest.raises(TypeError, match=match):
            diff_changes(sent, upserts, deletes)
    # A delete of a name no stream carries was never sent: skipped (the poller's quarantine lets it go).
    diff = diff_changes(sent, {}, {"p": [b"gone", 1, ["x"], "gone"], b"p": ["gone"], 2: [b"k"]})
    assert diff.upserts == {} and diff.deletes == {"p": ["gone"]}
    # One bad record is refused alone (quarantined by the poller), not the change set.
    for upserts, reason in [({1: {"k": {}}}, "partition id 1 is int"), ({"p": {"k": 3}}, "tags are int")]:
        diff = diff_changes(sent, {**upserts, "p2": {"fine": {}}}, {})
        assert [r.reason for r in diff.refused] == [f"{reason}, not str" if "partition" in reason
                                                   else f"{reason}, not a mapping"]
        assert diff.upserts["p2"] == {"fine": {}}


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
    thread = PollingThread(source, lambda kind, body, *_: emitted.append(kind) is None, interval=0.01)
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
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(JOIN_TIMEOUT)
        assert [proc.exitcode for proc in procs] == [0] * len(procs)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT)
            proc.close()


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
        readers = {interval: ListingReader(stores[interval], reconcile_interval=interval, listing_share=1.0)
                   for interval in stores}
        sent = {interval: {} for interval in readers}  # type: dict[float, Listing]
        for interval, reader in readers.items():
            commit_listing(sent[interval], reader.read(sent[interval], True), True)
            reader.commit()
        conn = sqlite3.connect(db)  # an edit the triggers do not see
        try:
            with conn:
                conn.execute("DROP TRIGGER kv_version_update")
                conn.execute("UPDATE kv SET tags = '{\"v\": 2}' WHERE key = 'a'")
        finally:
            conn.close()
        assert readers[3600.0].read(sent[3600.0], False).upserts == {}
        assert readers[0.0].read(sent[0.0], False).upserts == {"p": {"a": {"v": 2}}}
        assert stores[0.0].calls["kv_snapshot"] == 2 and stores[3600.0].calls["kv_changes"] == 1
    finally:
        for counting in stores.values():
            counting.close()
    with SqliteSource(db) as store:  # the next opener puts the missing trigger back
        cursor, _ = store.kv_snapshot()
        store.kv_put("a", "p", tag={"v": 3})
        assert store.kv_changes(cursor) == ((cursor[0], cursor[1] + 1), {"p": {"a": {"v": 3}}}, {})


def test_a_resync_with_a_change_feed_sends_what_was_sent_plus_the_changes_without_a_listing(db: Path) -> None:
    # A RESYNC means the receiver lost messages, not that the store changed behind the feed: what was
    # sent plus this poll's changes is the whole store, and a paused trainer costs the store no listing.
    source = _CountingSqliteSource(str(db))
    try:
        source.kv_batch_put([f"k{i}" for i in range(50)], "p", tags=[{"v": i} for i in range(50)])
        source.kv_put("x", "q", tag={"v": 0})
        reader = ListingReader(source)
        sent: Listing = {}
        commit_listing(sent, reader.read(sent, True), True)
        reader.commit()
        source.kv_put("k1", "p", tag={"v": 100})
        source.kv_clear(["k2"], "p")
        source.kv_clear(["x"], "q")
        source.kv_put("new", "r", tag={})
        diff = reader.read(sent, True)
        assert diff.upserts == source.kv_list() and diff.deletes == {}
        assert diff.upserts["p"]["k3"] is sent["p"]["k3"]  # unchanged keys are the dicts sent (not screened again)
        commit_listing(sent, diff, True)
        reader.commit()
        assert sent == source.kv_list()
        assert source.calls["kv_snapshot"] == 1 and source.calls["kv_changes"] == 1
    finally:
        source.close()

