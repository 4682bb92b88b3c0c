"""The SQLite store's change feed: what changed since a cursor, without listing the store.

Every write to ``kv`` takes the next value of one counter, ``kv_clock.version``,
and stores it in the row (``kv.version``, indexed); every delete is logged in
``kv_deleted`` with its version. SQLite triggers do both, so they run inside
the writer's own ``BEGIN IMMEDIATE`` transaction, whatever code wrote (also
an older version of this package, or a ``sqlite3`` shell)::

    kv_batch_put ─▶ kv row (tags, version=clock+1)
    kv_clear ─────▶ kv_deleted (partition, key, version=clock+1)
    poller ───────▶ rows and deletions with version > cursor, in one read transaction

Only one transaction writes at a time and the counter lives in the database,
so version order is commit order, and a reader's snapshot holds every
version up to the clock it reads in the same transaction: a cursor taken
with a read never skips a later commit.

The deletion log keeps the deletions of the last ``keep`` versions
(``kv_clock.keep``, default :data:`DEFAULT_KEEP_VERSIONS`); older ones are
pruned and ``kv_clock.pruned`` records the horizon. A cursor below it (or
from another file: the cursor carries the file's random id) gets ``None``:
the caller must take a full listing.
"""

from __future__ import annotations

import sqlite3
from typing import Any, Iterator

from .sqlite_io import StoredListing, fetch_all, fetch_batches, read_tags

__all__ = ["DEFAULT_KEEP_VERSIONS", "Cursor", "ensure_change_log", "read_changes", "read_snapshot"]

#: Deletions of this many most recent versions stay in the log (a poller
#: further behind takes a full listing). About 50 bytes per logged delete.
DEFAULT_KEEP_VERSIONS = 1_000_000

#: ``(store id, version)``: opaque to the poller.
Cursor = tuple[str, int]

# Each statement is idempotent, so a file written by an older version is
# migrated in place by whichever process opens it first.
_TABLES = (
    "CREATE TABLE IF NOT EXISTS kv_clock ("
    " id INTEGER PRIMARY KEY CHECK (id = 0),"
    " store_id TEXT NOT NULL,"
    " version INTEGER NOT NULL,"
    " pruned INTEGER NOT NULL,"
    " keep INTEGER NOT NULL)",
    f"INSERT OR IGNORE INTO kv_clock VALUES (0, lower(hex(randomblob(8))), 0, 0, {DEFAULT_KEEP_VERSIONS})",
    "CREATE TABLE IF NOT EXISTS kv_deleted ("
    " partition_id TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " version INTEGER NOT NULL,"
    " PRIMARY KEY (partition_id, key)"
    ") WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS kv_deleted_by_version ON kv_deleted (version)",
    "CREATE INDEX IF NOT EXISTS kv_by_version ON kv (version)",
)

_STAMP_ROW = (
    " UPDATE kv_clock SET version = version + 1;"
    " UPDATE kv SET version = (SELECT version FROM kv_clock)"
    " WHERE partition_id = NEW.partition_id AND key = NEW.key;"
)

_TRIGGERS = (
    # A key deleted then put again is an upsert: its log entry goes.
    "CREATE TRIGGER IF NOT EXISTS kv_version_insert AFTER INSERT ON kv BEGIN" + _STAMP_ROW +
    " DELETE FROM kv_deleted WHERE partition_id = NEW.partition_id AND key = NEW.key; END",
    # A put that leaves the tags as they were is no change.
    "CREATE TRIGGER IF NOT EXISTS kv_version_update AFTER UPDATE OF tags ON kv"
    " WHEN OLD.tags IS NOT NEW.tags BEGIN" + _STAMP_ROW + " END",
    "CREATE TRIGGER IF NOT EXISTS kv_version_delete AFTER DELETE ON kv BEGIN"
    " UPDATE kv_clock SET version = version + 1;"
    " INSERT OR REPLACE INTO kv_deleted (partition_id, key, version)"
    " VALUES (OLD.partition_id, OLD.key, (SELECT version FROM kv_clock)); END",
    # Prune in steps of keep/16 versions, so that a delete rarely pays for it.
    "CREATE TRIGGER IF NOT EXISTS kv_deleted_prune AFTER INSERT ON kv_deleted"
    " WHEN NEW.version - (SELECT keep FROM kv_clock) > (SELECT pruned FROM kv_clock) + (SELECT keep FROM kv_clock) / 16"
    " BEGIN"
    " UPDATE kv_clock SET pruned = NEW.version - keep;"
    " DELETE FROM kv_deleted WHERE version <= (SELECT pruned FROM kv_clock); END",
)

_NAMES = ("kv_clock", "kv_deleted", "kv_deleted_by_version", "kv_by_version", "kv_version_insert",
          "kv_version_update", "kv_version_delete", "kv_deleted_prune")


def ensure_change_log(conn: sqlite3.Connection) -> None:
    """Add the version column, the clock, the deletion log and the triggers where missing.

    Cheap when everything is there (one read); otherwise migrates in one
    ``BEGIN IMMEDIATE`` transaction, so processes opening an old file at
    once migrate it once. Rows that existed before get version 0.
    """
    if _complete(conn):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(kv)")}
        if "version" not in columns:
            conn.execute("ALTER TABLE kv ADD COLUMN version INTEGER NOT NULL DEFAULT 0")
        for statement in _TABLES + _TRIGGERS:
            conn.execute(statement)
        conn.execute("COMMIT")
    except BaseException:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        raise


def _complete(conn: sqlite3.Connection) -> bool:
    marks = ",".join("?" * len(_NAMES))
    (found,) = conn.execute(f"SELECT count(*) FROM sqlite_master WHERE name IN ({marks})", _NAMES).fetchone()
    return bool(found == len(_NAMES))


def read_snapshot(conn: sqlite3.Connection) -> tuple[Cursor, StoredListing]:
    """Every row and the cursor that follows them, from one read transaction."""
    pieces = snapshot_pieces(conn, 65536)
    cursor = next(pieces)
    listing: StoredListing = {}
    for piece in pieces:
        for partition, items in piece.items():
            listing.setdefault(partition, {}).update(items)
    return cursor, listing


def snapshot_pieces(conn: sqlite3.Connection, size: int) -> Iterator[Any]:
    """The cursor, then every row in listings of at most ``size`` rows, from one read transaction.

    The transaction stays open until the generator is exhausted or closed:
    its caller must close it (a reader that stops early holds the
    connection until then).
    """
    with _read(conn):
        store_id, version, _ = _clock(conn)
        yield store_id, version
        for batch in fetch_batches(conn, "SELECT partition_id, key, tags FROM kv ORDER BY partition_id, key", size):
            listing: StoredListing = {}
            for partition, key, text in batch:
                listing.setdefault(partition, {})[key] = read_tags(text)
            yield listing


def read_changes(conn: sqlite3.Connection, cursor: Any) -> (
        tuple[Cursor, StoredListing, dict[Any, list[Any]]] | None):
    """Rows written and keys deleted after ``cursor``, from one read transaction.

    Returns ``None`` when the cursor cannot be served: from another file
    (deleted and created anew, or replaced), ahead of this file, or older
    than the pruned deletion log.

    Raises:
        TypeError: ``cursor`` is not one this module made.
    """
    if (not isinstance(cursor, tuple) or len(cursor) != 2 or not isinstance(cursor[0], str)
            or not isinstance(cursor[1], int) or isinstance(cursor[1], bool)):
        raise TypeError(f"not a change cursor of this store: {cursor!r}")
    with _read(conn):
        store_id, version, pruned = _clock(conn)
        since = cursor[1]
        if cursor[0] != store_id or since > version or since < pruned:
            return None
        rows = fetch_all(conn, "SELECT partition_id, key, tags FROM kv WHERE version > ?", (since,))
        gone = fetch_all(conn, "SELECT partition_id, key FROM kv_deleted WHERE version > ?", (since,))
    upserts: StoredListing = {}
    for partition, key, text in rows:
        upserts.setdefault(partition, {})[key] = read_tags(text)
    deletes: dict[Any, list[Any]] = {}
    for partition, key in gone:
        deletes.setdefault(partition, []).append(key)
    return (store_id, version), upserts, deletes


def _clock(conn: sqlite3.Connection) -> tuple[str, int, int]:
    store_id, version, pruned = conn.execute("SELECT store_id, version, pruned FROM kv_clock").fetchone()
    return str(store_id), int(version), int(pruned)


class _read:
    """A read transaction: every SELECT in it sees the same snapshot (WAL)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.execute("BEGIN")

    def __exit__(self, *exc: object) -> None:
        try:
            self._conn.execute("COMMIT")
        except sqlite3.Error:
            if exc[0] is None:
                raise
