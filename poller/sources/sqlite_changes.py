"""The SQLite store's change feed: what changed since a cursor, without listing the store.

SQLite triggers log every write inside the writer's own transaction, whatever code wrote: each write appends
a row to ``kv_versions`` (rowid = version, with a random 31-bit ``stamp``) and stores the version in the
written row (``kv.version``, indexed); each delete is logged in ``kv_deleted``::

    kv_batch_put ─▶ kv_versions (version=last+1, stamp) ─▶ kv row (tags, version)
    kv_clear ─────▶ kv_versions (version=last+1, stamp) ─▶ kv_deleted (partition, key, version)
    poller ───────▶ rows and deletions with version > cursor, in one read transaction

One writer at a time, the log in the database: version order is commit order, so a read's cursor skips no later commit.

A cursor is ``(store id, version, stamp)``, served only if the file still logs that version with that stamp: a
restored backup keeps the store id and reuses the versions the poller saw for other writes, but not their stamps,
so it gets ``None`` and a full listing. So does a cursor older than the logs keep (:data:`DEFAULT_KEEP_VERSIONS`),
ahead of the file or from another file. ``kv_clock.version`` stays within 4096 versions of the last one, so a
reader of an older version of this package re-reads at most that many changes.
"""

from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from typing import Any, Iterator

from poller.sources.sqlite_io import StoredListing, fetch_all, fetch_batches, immediate, listing_of

__all__ = ["DEFAULT_KEEP_VERSIONS", "Cursor", "ensure_change_log", "read_changes", "read_snapshot"]

#: Deletions and stamps of this many recent versions stay in the logs (a poller further behind takes a full
#: listing); ~13 bytes per version, ~50 per logged delete.
DEFAULT_KEEP_VERSIONS = 1_000_000

#: ``(store id, version, stamp)``: opaque to the poller.
Cursor = tuple[str, int, int]

# Each statement is idempotent: whichever process opens an older version's file first migrates it in place.
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
    # The rowid is the version: an append takes max + 1, and the last row is never pruned.
    "CREATE TABLE IF NOT EXISTS kv_versions (version INTEGER PRIMARY KEY, stamp INTEGER NOT NULL)",
    # Versions go on from the highest one the file used (also one an older version's triggers wrote).
    "INSERT INTO kv_versions (version, stamp)"
    " SELECT v, random() & 2147483647 FROM (SELECT max((SELECT version FROM kv_clock),"
    " coalesce((SELECT max(version) FROM kv), 0), coalesce((SELECT max(version) FROM kv_deleted), 0)) AS v)"
    " WHERE v > coalesce((SELECT max(version) FROM kv_versions), -1)",
)

# A new version: the log's next row; 31 bits of stamp, so that it takes 4 bytes.
_NEW_VERSION = " INSERT INTO kv_versions (stamp) VALUES (random() & 2147483647);"
_STAMP_ROW = (
    _NEW_VERSION +
    " UPDATE kv SET version = last_insert_rowid()"
    " WHERE partition_id = NEW.partition_id AND key = NEW.key;"
)

# Named as older versions named theirs, so an older version opening the file finds them in place (and adds
# none beside them); a body without kv_versions is old.
_WRITE_TRIGGERS = {
    # A key deleted then put again is an upsert: its log entry goes.
    "kv_version_insert": "CREATE TRIGGER kv_version_insert AFTER INSERT ON kv BEGIN" + _STAMP_ROW +
    " DELETE FROM kv_deleted WHERE partition_id = NEW.partition_id AND key = NEW.key; END",
    # A put that leaves the tags as they were is no change.
    "kv_version_update": "CREATE TRIGGER kv_version_update AFTER UPDATE OF tags ON kv"
    " WHEN OLD.tags IS NOT NEW.tags BEGIN" + _STAMP_ROW + " END",
    "kv_version_delete": "CREATE TRIGGER kv_version_delete AFTER DELETE ON kv BEGIN" + _NEW_VERSION +
    " INSERT OR REPLACE INTO kv_deleted (partition_id, key, version)"
    " VALUES (OLD.partition_id, OLD.key, last_insert_rowid()); END",
}

_TRIGGERS = (
    # Prune in steps of keep/16 versions, so that a delete rarely pays for it.
    "CREATE TRIGGER IF NOT EXISTS kv_deleted_prune AFTER INSERT ON kv_deleted"
    " WHEN NEW.version - (SELECT keep FROM kv_clock) > (SELECT pruned FROM kv_clock) + (SELECT keep FROM kv_clock) / 16"
    " BEGIN"
    " UPDATE kv_clock SET pruned = NEW.version - keep;"
    " DELETE FROM kv_deleted WHERE version <= (SELECT pruned FROM kv_clock); END",
    # Every 4096 versions: the old counter catches up; the version log drops what is older than keep (not its last row).
    "CREATE TRIGGER IF NOT EXISTS kv_versions_prune AFTER INSERT ON kv_versions"
    " WHEN NEW.version % 4096 = 0 BEGIN"
    " UPDATE kv_clock SET version = NEW.version;"
    " DELETE FROM kv_versions WHERE version < NEW.version - (SELECT keep FROM kv_clock); END",
)

_NAMES = ("kv_clock", "kv_deleted", "kv_deleted_by_version", "kv_by_version", "kv_versions", "kv_deleted_prune",
          "kv_versions_prune", *_WRITE_TRIGGERS)


def ensure_change_log(conn: sqlite3.Connection) -> None:
    """Add the version column, the clock, the logs and the triggers where missing or older.

    One read when all is there; else one ``BEGIN IMMEDIATE`` migration, so processes opening an old file
    at once migrate it once. Older rows keep their version (0 before the change feed).
    """
    if _complete(conn):
        return
    with immediate(conn):
        if _complete(conn):  # another process migrated it while this one waited for the lock
            return
        columns = {row[1] for row in conn.execute("PRAGMA table_info(kv)")}
        if "version" not in columns:
            conn.execute("ALTER TABLE kv ADD COLUMN version INTEGER NOT NULL DEFAULT 0")
        for statement in _TABLES:
            conn.execute(statement)
        for name, statement in _WRITE_TRIGGERS.items():
            conn.execute(f"DROP TRIGGER IF EXISTS {name}")
            conn.execute(statement)
        for statement in _TRIGGERS:
            conn.execute(statement)


def _complete(conn: sqlite3.Connection) -> bool:
    marks = ",".join("?" * len(_NAMES))
    found = dict(conn.execute(f"SELECT name, sql FROM sqlite_master WHERE name IN ({marks})", _NAMES).fetchall())
    return len(found) == len(_NAMES) and all("kv_versions" in found[name] for name in _WRITE_TRIGGERS)


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
    """The cursor, then every row in listings of at most ``size`` rows, from one read transaction (open till closed)."""
    with _read(conn):
        store_id, _ = _clock(conn)
        yield (store_id, *_last_version(conn))
        for batch in fetch_batches(conn, "SELECT partition_id, key, tags FROM kv ORDER BY partition_id, key", size):
            yield listing_of(batch)


def read_changes(conn: sqlite3.Connection, cursor: Any) -> (
        tuple[Cursor, StoredListing, dict[Any, list[Any]]] | None):
    """Rows written and keys deleted after ``cursor``, from one read transaction; None when it cannot be served.

    Raises:
        TypeError: ``cursor`` is not one this module made.
    """
    if (not isinstance(cursor, tuple) or len(cursor) != 3 or not isinstance(cursor[0], str)
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in cursor[1:])):
        raise TypeError(f"not a change cursor of this store: {cursor!r}")
    store, since, stamp = cursor
    with _read(conn):
        store_id, pruned = _clock(conn)
        if store != store_id or since < pruned:
            return None
        logged = conn.execute("SELECT stamp FROM kv_versions WHERE version = ?", (since,)).fetchone()
        if logged is None or logged[0] != stamp:
            return None
        last = _last_version(conn)
        rows = fetch_all(conn, "SELECT partition_id, key, tags FROM kv WHERE version > ?", (since,))
        gone = fetch_all(conn, "SELECT partition_id, key FROM kv_deleted WHERE version > ?", (since,))
    deletes: dict[Any, list[Any]] = {}
    for partition, key in gone:
        deletes.setdefault(partition, []).append(key)
    return (store_id, *last), listing_of(rows), deletes


def _clock(conn: sqlite3.Connection) -> tuple[str, int]:
    """The file's store id and the deletion log's horizon."""
    store_id, pruned = conn.execute("SELECT store_id, pruned FROM kv_clock").fetchone()
    return str(store_id), int(pruned)


def _last_version(conn: sqlite3.Connection) -> tuple[int, int]:
    """The last version written and its stamp."""
    version, stamp = conn.execute("SELECT version, stamp FROM kv_versions ORDER BY version DESC LIMIT 1").fetchone()
    return int(version), int(stamp)


@contextmanager
def _read(conn: sqlite3.Connection) -> Iterator[None]:
    """A read transaction: every SELECT in it sees the same snapshot (WAL)."""
    conn.execute("BEGIN")
    try:
        yield
    except BaseException:
        try:
            conn.execute("COMMIT")
        except sqlite3.Error:
            pass
        raise
    conn.execute("COMMIT")
