"""The SQLite store read in pieces for a snapshot (kv_snapshot_pieces): same content, bounded hold, no leak."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

from poller.diff import Sent
from poller.polling import MAX_FAILURES, PollingThread
from poller.reader import ListingReader
from poller.sources.sqlite import SqliteSource
from poller.wire.protocol import DEFAULT_LIMITS, Kind

JOIN_TIMEOUT = 60.0


def _fill(store: SqliteSource, keys: int) -> None:
    store.kv_batch_put([f"k{i}" for i in range(keys)], "a", tags=[{"i": i} for i in range(keys)])
    store.kv_batch_put([f"v{i}" for i in range(keys // 3)], "b", tags=[{"i": i} for i in range(keys // 3)])


def test_a_snapshot_read_in_pieces_is_the_snapshot_read_whole(db: Path) -> None:
    with SqliteSource(str(db)) as store:
        _fill(store, 1000)
        cursor, whole = store.kv_snapshot()
        piece_cursor, pieces = store.kv_snapshot_pieces(128)
        merged: dict[str, dict[str, Any]] = {}
        sizes = []
        for piece in pieces:
            sizes.append(sum(map(len, piece.values())))
            for partition, items in piece.items():
                merged.setdefault(partition, {}).update(items)
        assert piece_cursor == cursor and merged == whole
        assert max(sizes) <= 128 and sum(sizes) == 1333


def test_the_pieces_are_one_read_and_a_write_meanwhile_comes_from_the_change_feed(db: Path) -> None:
    with SqliteSource(str(db)) as store, SqliteSource(str(db)) as writer:
        _fill(store, 300)
        cursor, pieces = store.kv_snapshot_pieces(100)
        first = next(pieces)
        # Another connection writes while the read transaction is open (WAL: it does not wait for it).
        writer.kv_put("late", "a", tag={"new": True})
        writer.kv_clear(["k299"], "a")
        rest = list(pieces)
        seen = {key for piece in [first, *rest] for items in piece.values() for key in items}
        assert "late" not in seen and "k299" in seen
        changes = store.kv_changes(cursor)
        assert changes is not None
        _, upserts, deletes = changes
        assert upserts == {"a": {"late": {"new": True}}} and deletes == {"a": ["k299"]}


def test_a_snapshot_given_up_half_way_lets_the_store_go(db: Path) -> None:
    with SqliteSource(str(db)) as store:
        _fill(store, 300)
        _, pieces = store.kv_snapshot_pieces(10)
        next(pieces)
        pieces.close()  # type: ignore[attr-defined]
        done = threading.Event()

        def read_and_write() -> None:
            store.kv_snapshot()
            store.kv_put("x", "a")
            done.set()

        worker = threading.Thread(target=read_and_write)
        worker.start()
        worker.join(JOIN_TIMEOUT)
        assert done.is_set()


class _FailsAfter:
    """A snapshot's pieces that fail after ``count`` were taken (as a disk error would), the store's read still open.

    Closing it closes the store's iterator: only the poller's close lets the store go.
    """

    def __init__(self, pieces: Any, count: int) -> None:
        self._pieces = pieces
        self._left = count

    def __iter__(self) -> "_FailsAfter":
        return self

    def __next__(self) -> Any:
        if not self._left:
            raise sqlite3.OperationalError("disk I/O error (injected)")
        self._left -= 1
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()


class _FailsHalfWay(SqliteSource):
    """A real store whose snapshot read fails after the first pieces were taken."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.snapshots = 0

    def kv_snapshot_pieces(self, size: int = 4096) -> Any:
        self.snapshots += 1
        cursor, pieces = super().kv_snapshot_pieces(16)
        return cursor, _FailsAfter(pieces, 3)


def test_a_snapshot_that_fails_half_way_is_reported_and_read_again_without_a_hang(db: Path) -> None:
    store = _FailsHalfWay(str(db))
    _fill(store, 200)
    emitted: list[Kind] = []

    def emit(kind: Kind, body: bytes, starts_snapshot: bool, stopping: threading.Event) -> bool:
        emitted.append(kind)
        return True

    thread = PollingThread(store, emit, poll_interval=0.01)
    thread.start()
    try:
        thread.join(JOIN_TIMEOUT)
        assert not thread.is_alive()
    finally:
        thread.stop()
        thread.join(JOIN_TIMEOUT)
        store.close()
    # Each attempt sent the pieces before the failure, then failed; the store was free for the next one.
    assert store.snapshots == MAX_FAILURES and isinstance(thread.failed, sqlite3.OperationalError)
    assert emitted.count(Kind.ERROR) == MAX_FAILURES and Kind.DELTA in emitted


def test_the_reader_times_a_listing_read_in_pieces_once_it_is_read(db: Path) -> None:
    with SqliteSource(str(db)) as store:
        _fill(store, 300)
        reader = ListingReader(store)
        sent: Sent = {}
        snapshot = reader.read(sent, True, limits=DEFAULT_LIMITS, size=4096)
        assert reader.duty.listings == 0  # nothing read yet but the cursor
        assert sum(len(keys) for piece in snapshot for keys, _ in piece.values()) == 400
        assert reader.duty.listings == 1
