"""The embedded default store: a key-value store of tags (and JSON fields) in one SQLite file.

It speaks TransferQueue's KV API, so the poller, the demo and the tests need no Ray, torch or controller, and
offers a change feed (the change log, below). Any number of processes share a file::

    writer processes ──kv_batch_put──▶ kv.db (WAL) ◀──kv_changes()── poller thread
    trainer ─────────────kv_clear────▶

Built from a spec in any process, so the connection opens on first use, in the process that uses it (anew
after a fork). Fields are JSON only (not tensors), which verl's DAPO metric is.

The change feed: SQLite triggers log every write inside the writer's own transaction, whatever code wrote.
Each write appends a row to ``kv_versions`` (rowid = version, with a random 31-bit ``stamp``) and stores the
version in the written row (``kv.version``, indexed); each delete is logged in ``kv_deleted``, and a rename
(another tool's ``UPDATE`` of ``key`` or ``partition_id``) is both::

    kv_batch_put ─▶ kv_versions (version=last+1, stamp) ─▶ kv row (tags, version)
    kv_clear ─────▶ kv_versions (version=last+1, stamp) ─▶ kv_deleted (partition, key, version)
    rename ───────▶ kv_versions (version=last+1, stamp) ─▶ kv_deleted (the old name) and kv row (the new)
    poller ───────▶ rows and deletions with version > cursor, in one read transaction

One writer at a time, the log in the database: version order is commit order, so a read's cursor skips no
later commit. A cursor is ``(store id, version, stamp)``, served only if the file still logs that version with
that stamp: a restored backup keeps the store id and reuses the versions the poller saw for other writes, but
not their stamps, so it gets ``None`` and a full listing. So does a cursor older than the logs keep
(:data:`DEFAULT_KEEP_VERSIONS`), ahead of the file or from another file. ``kv_clock.version`` stays within 4096
versions of the last one, so a reader of an older version of this package re-reads at most that many changes.

Other tools may empty, trim or drop the logs and the clock, or drop a trigger. Every read of the feed and every
write checks the log first (~4 us; a write ~1 us, the schema's version alone) and mends it in one transaction:
the logs re-created, the versions going on from the highest one the file used, and a new version made the
horizon (``kv_clock.pruned``), so every cursor from before the mend gets ``None``. A delete removed from
``kv_deleted`` by hand moves the horizon past it (a trigger). The worst another tool's edit costs is a full listing.

Sections, in order: :class:`SqliteSource` (the API), connections and transactions, the change log (its schema,
triggers and reads). Rows are fetched and parsed, checked and encoded by :mod:`poller.sources.sqlite_io`.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

from poller.sources import sqlite_io
from poller.sources.sqlite_io import StoredListing, fetch_all, fetch_listing, fetch_listings, listing_of

__all__ = ["DEFAULT_KEEP_VERSIONS", "Cursor", "SqliteSource"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Deletions and stamps of this many recent versions stay in the logs (a poller further behind takes a full
#: listing); ~13 bytes per version, ~50 per logged delete.
DEFAULT_KEEP_VERSIONS = 1_000_000

#: ``(store id, version, stamp)``: opaque to the poller.
Cursor = tuple[str, int, int]

_UPSERTS = {table: f"INSERT INTO {table} (partition_id, key, {column}) VALUES (?, ?, ?)"
                   f" ON CONFLICT (partition_id, key) DO UPDATE SET {column} = excluded.{column}"
            for table, column in (("kv", "tags"), ("kv_fields", "fields"))}

# Connections inherited through fork() are parked here, never touched again: SQLite forbids using one
# across fork, and closing one in the child counts as use (it may checkpoint or delete the parent's WAL).
_INHERITED: list[sqlite3.Connection] = []


class SqliteSource:
    """A key-value store of ``{partition_id: {key: tags}}`` in a SQLite file.

    Safe to share between processes (one connection each, WAL) and threads (one connection per instance,
    under a lock). Every read-modify-write runs in ``BEGIN IMMEDIATE``, so concurrent merges lose nothing.

    Args:
        path: the database file, created (with its directory) on first use.
        timeout: seconds to wait for another process's write lock before :class:`sqlite3.OperationalError`.

    Example:
        >>> with SqliteSource(tmp / "kv.db") as store:  # doctest: +SKIP
        ...     store.kv_put("k1", "train", tag={"global_steps": 1, "status": "running"})
        ...     store.kv_put("k1", "train", tag={"status": "success"})
        ...     store.kv_list()
        {'train': {'k1': {'global_steps': 1, 'status': 'success'}}}
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 10.0) -> None:
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout >= 0:
            raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
        self._path = os.fspath(path)
        if not isinstance(self._path, str):
            raise TypeError(f"path must be a str or os.PathLike[str], got {type(path).__name__}")
        self._timeout = float(timeout)
        self._reset()

    def _reset(self) -> None:
        """Start with no connection and a fresh lock (also for unpickled copies)."""
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._conn: sqlite3.Connection | None = None
        self._conn_pid: int | None = None
        self._conn_file: tuple[int, int] | None = None

    # -- pickling: spawn children get the address, never a live connection --

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self._path, "timeout": self._timeout}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self._path = state["path"]
        self._timeout = state["timeout"]
        self._reset()

    def __repr__(self) -> str:
        state = "open" if self._conn is not None and self._conn_pid == os.getpid() else "idle"
        return f"<SqliteSource path={self._path!r} {state}>"

    @property
    def path(self) -> str:
        """The database file this store lives in."""
        return self._path

    # -- public API (TransferQueue's KV signatures) ---------------------------

    def kv_put(self, key: str, partition_id: str, fields: Any = None, tag: dict[str, Any] | None = None) -> None:
        """Store one key, merging ``tag`` into its tags and ``fields`` into its fields (:meth:`kv_batch_put`)."""
        sqlite_io.check_str("key", key)
        if fields is not None and not isinstance(fields, Mapping):
            raise TypeError(f"fields must be a dict of field name -> value, got {type(fields).__name__}")
        self.kv_batch_put([key], partition_id, None if fields is None else [dict(fields)],
                          None if tag is None else [tag])

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: Any = None,
                     tags: list[dict[str, Any]] | None = None) -> None:
        """Store many keys in one transaction (all or none), merging each key's tags and fields.

        Merging is ``dict.update`` on the top level, from ``{}``; a key listed twice gets both, in order.

        Args:
            tags: one dict per key (``None``: ``{}`` each), JSON values only.
            fields: one ``{name: value}`` dict per key, or columns ``{name: [value per key]}`` (TransferQueue's
                TensorDict shape); ``None`` leaves the fields alone.

        Raises:
            TypeError: a key, the partition id, a tag or a field has the wrong type.
            ValueError: ``len(tags) != len(keys)``, a value JSON cannot carry (NaN), or stored tags or fields
                another tool wrote that cannot be read (nothing is written).
            sqlite3.OperationalError: the write lock was not had in time.
        """
        sqlite_io.check_str("partition_id", partition_id)
        key_list = sqlite_io.check_keys(keys)
        tag_list = [{} for _ in key_list] if tags is None else sqlite_io.json_rows("tags", key_list, tags)
        field_list = None if fields is None else sqlite_io.json_rows("fields", key_list, fields)
        if not key_list:
            return
        with self._connection() as conn, _immediate(conn):
            _mend_change_log(conn, writing=True)
            for table, updates in (("kv", tag_list), ("kv_fields", field_list)):
                if updates is None:
                    continue
                merged = sqlite_io.select_json(conn, partition_id, key_list, table=table)
                for key, update in zip(key_list, updates):
                    merged.setdefault(key, {}).update(update)
                # Values were checked above; dumping cannot fail half-way through.
                conn.executemany(_UPSERTS[table], [(partition_id, key, sqlite_io.dumps(merged[key]))
                                                   for key in dict.fromkeys(key_list)])

    def kv_list(self, partition_id: str | None = None) -> StoredListing:
        """Everything stored (or only ``partition_id``'s) as fresh ``{partition_id: {key: tags}}`` dicts.

        One ``SELECT``: a consistent snapshot while others write. A row another tool wrote never fails the
        listing (:data:`~poller.sources.sqlite_io.StoredListing`): tags that are no JSON object are an
        :class:`~poller.wire.vocabulary.UnreadableValue`, a BLOB or non-UTF-8 key or partition id ``bytes``.

        Raises:
            TypeError: ``partition_id`` is neither None nor a str.
        """
        if partition_id is not None:
            sqlite_io.check_str("partition_id", partition_id)
        where, params = ("", ()) if partition_id is None else (" WHERE partition_id = ?", (partition_id,))
        with self._connection() as conn:
            rows = fetch_all(conn, "SELECT partition_id, key, tags FROM kv" + where, params)
        return listing_of(rows)  # parsed outside the lock: another thread's call need not wait for it

    def kv_snapshot(self) -> tuple[Cursor, StoredListing]:
        """Everything stored, as :meth:`kv_list`, and the change cursor right after it."""
        with self._change_log() as conn:
            return _read_snapshot(conn)

    def kv_snapshot_pieces(self, size: int = 4096) -> tuple[Cursor, Iterator[StoredListing]]:
        """:meth:`kv_snapshot` in listings of at most ``size`` rows, each parsed only when taken.

        The trainer applies keys as they are read. Every piece comes from the cursor's read transaction, held
        with this store's lock until the iterator is exhausted or closed: close it when stopping early.
        """
        pieces = self._snapshot_pieces(size)
        try:
            return next(pieces), pieces  # the cursor comes first; the generator then holds its first listing
        except BaseException:
            pieces.close()
            raise

    def _snapshot_pieces(self, size: int) -> Generator[Any, None, None]:
        with self._change_log() as conn:
            yield from _read_snapshot_pieces(conn, size)

    def kv_changes(self, cursor: Any) -> tuple[Cursor, StoredListing, dict[Any, list[Any]]] | None:
        """What was put or cleared after ``cursor``: ``(cursor, upserts, deletes)``, or ``None``.

        ``None``: the cursor is from another file, another history of this one (restored from a backup) or
        older than the pruned logs (the change log, below). Rows read as by :meth:`kv_list`.

        Raises:
            TypeError: ``cursor`` did not come from this store.
        """
        with self._change_log() as conn:
            return _read_changes(conn, cursor)

    def kv_clear(self, keys: list[str], partition_id: str) -> None:
        """Delete ``keys`` (and their fields) from ``partition_id``; missing keys are fine."""
        sqlite_io.check_str("partition_id", partition_id)
        key_list = sqlite_io.check_keys(keys)
        if not key_list:
            return
        with self._connection() as conn, _immediate(conn):
            _mend_change_log(conn, writing=True)
            rows = [(partition_id, key) for key in key_list]
            conn.executemany("DELETE FROM kv WHERE partition_id = ? AND key = ?", rows)
            conn.executemany("DELETE FROM kv_fields WHERE partition_id = ? AND key = ?", rows)

    def kv_batch_get(self, keys: list[str], partition_id: str,
                     select_fields: list[str] | str | None = None) -> dict[str, list[Any]]:
        """The stored fields of ``keys`` (which must exist), as columns ``{name: [value per key]}``.

        ``select_fields``: a name or a list (``None``: every field any key has); a key without one gets ``None``.

        Raises:
            KeyError: some keys are not stored (the first few are named).
            ValueError: stored tags or fields another tool wrote cannot be read (the key is named).
        """
        sqlite_io.check_str("partition_id", partition_id)
        key_list = sqlite_io.check_keys(keys)
        if isinstance(select_fields, str):
            select_fields = [select_fields]
        names = None if select_fields is None else sqlite_io.check_keys(select_fields)
        with self._connection() as conn:
            present = sqlite_io.select_json(conn, partition_id, key_list)
            stored = sqlite_io.select_json(conn, partition_id, key_list, table="kv_fields")
        missing = [key for key in key_list if key not in present]
        if missing:
            raise KeyError(f"{len(missing)} key(s) not stored in partition {partition_id!r}: {missing[:5]}")
        if names is None:
            names = list(dict.fromkeys(name for key in key_list for name in stored.get(key, {})))
        return {name: [stored.get(key, {}).get(name) for key in key_list] for name in names}

    def close(self) -> None:
        """Close this instance's connection (idempotent); a later call opens a new one."""
        with self._checked_lock():
            conn, self._conn = self._conn, None
            if conn is None:
                return
            if self._conn_pid != os.getpid():
                _INHERITED.append(conn)
                return
            conn.close()
            logger.debug("closed %s", self._path)

    def __enter__(self) -> SqliteSource:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- private: connection and transactions ---------------------------------

    def _checked_lock(self) -> threading.Lock:
        # After a fork the lock may be held by a parent thread that the child lacks: a child takes a fresh one.
        pid = os.getpid()
        if self._lock_pid != pid:
            self._lock = threading.Lock()
            self._lock_pid = pid
        return self._lock

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        """This process's connection, held under the lock for the block."""
        with self._checked_lock():
            pid = os.getpid()
            if self._conn is not None and self._conn_pid != pid:
                logger.debug("pid changed (%s -> %s): reopening %s", self._conn_pid, pid, self._path)
                _INHERITED.append(self._conn)
                self._conn = None
            if self._conn is not None:
                self._check_file()
            if self._conn is None:
                self._conn = _open_connection(self._path, self._timeout)
                self._conn_pid = pid
                self._conn_file = self._file_id()
            yield self._conn

    @contextmanager
    def _change_log(self) -> Iterator[sqlite3.Connection]:
        """:meth:`_connection`, the change log checked first (cheap): a backup restored in place may predate it."""
        with self._connection() as conn:
            _ensure_change_log(conn)
            yield conn

    def _file_id(self) -> tuple[int, int] | None:
        if self._path == ":memory:" or self._path.startswith("file:"):
            return None
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def _check_file(self) -> None:
        """Drop a connection whose file was deleted or replaced (SQLite would read an unlinked file forever).

        Raises:
            FileNotFoundError: the file is gone; the next call starts a new one.
        """
        if self._conn_file is None:
            return
        current = self._file_id()
        if current == self._conn_file:
            return
        assert self._conn is not None
        self._conn.close()
        self._conn = None
        if current is None:
            raise FileNotFoundError(f"{self._path} was deleted while open; the next call opens a new store")
        logger.warning("%s was replaced while open; reopening it", self._path)


# -- connections and transactions -----------------------------------------------------------------

@contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` (the write lock up front: DEFERRED fails on upgrade, not waits), COMMIT or ROLLBACK."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        # Also after a failed COMMIT: a transaction left open would make every later BEGIN fail.
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:  # SQLite may already have rolled back (e.g. on SQLITE_FULL)
            pass
        raise


# Tags in kv; fields in a table of their own, so files written before fields were kept need no migration.
_SCHEMA = tuple(
    f"CREATE TABLE IF NOT EXISTS {table} (partition_id TEXT NOT NULL, key TEXT NOT NULL, {column} TEXT NOT NULL,"
    " PRIMARY KEY (partition_id, key)) WITHOUT ROWID"
    for table, column in (("kv", "tags"), ("kv_fields", "fields")))


def _open_connection(path: str, timeout: float) -> sqlite3.Connection:
    """A connection to ``path`` in WAL mode with both tables and the change log, retrying a busy file."""
    directory = os.path.dirname(os.path.abspath(path))
    if path != ":memory:" and not path.startswith("file:"):
        os.makedirs(directory, exist_ok=True)
    # The store issues BEGIN/COMMIT itself, and its lock serializes all use (the poller lists from a helper thread).
    conn = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False,
                           uri=path.startswith("file:"), factory=_Connection)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
        # WAL lets kv_list() read while a writer holds the lock; only the first opener changes the file's mode.
        mode = _retry_busy(timeout, lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        if mode != "wal":
            logger.debug("%s: journal_mode is %s, not wal", path, mode)
        # NORMAL survives process crashes in WAL; a power loss may drop the last transactions: affordable here.
        conn.execute("PRAGMA synchronous = NORMAL")
        for table in _SCHEMA:
            _retry_busy(timeout, partial(conn.execute, table))
        _retry_busy(timeout, lambda: _ensure_change_log(conn))
    except BaseException:
        conn.close()
        raise
    logger.debug("opened %s (pid %d)", path, os.getpid())
    return conn


class _Connection(sqlite3.Connection):
    """A connection that remembers the schema version at which it last found the change log's schema whole."""

    log_schema: int | None = None


def _retry_busy(timeout: float, call: Callable[[], _T]) -> _T:
    """Run ``call``, retrying "database is locked" until ``timeout`` seconds pass.

    Switching a fresh file to WAL needs an exclusive lock, for which SQLite runs no busy handler: processes
    opening a new file at once got SQLITE_BUSY at once.
    """
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            return call()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            if time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


# -- the change log -------------------------------------------------------------------------------

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
    # Versions go on from the highest one the file used (also one an older version's triggers wrote, or the horizon
    # a mend set, below): into a new log, one another tool emptied, or one it emptied and wrote into.
    "INSERT INTO kv_versions (version, stamp)"
    " SELECT v, random() & 2147483647 FROM (SELECT max((SELECT max(version, pruned) FROM kv_clock),"
    " coalesce((SELECT max(version) FROM kv), 0), coalesce((SELECT max(version) FROM kv_deleted), 0)) AS v)"
    " WHERE v > coalesce((SELECT max(version) FROM kv_versions), -1)",
)

# A new version: the log's next row; 31 bits of stamp, so that it takes 4 bytes. In a log another tool emptied
# the rowid starts again at 1, below the rows' versions: the next check finds the log behind them and mends it
# (_LOG_STATE), and a version used twice is harmless (its stamp differs). Numbering each write from the rows' and
# deletions' versions instead cost every insert and clear ~5% more.
_NEXT_VERSION = "INSERT INTO kv_versions (stamp) VALUES (random() & 2147483647)"
_NEW_VERSION = f" {_NEXT_VERSION};"
_STAMP_ROW = (
    _NEW_VERSION +
    " UPDATE kv SET version = last_insert_rowid()"
    " WHERE partition_id = NEW.partition_id AND key = NEW.key;"
)

# Named as older versions named theirs, so an older version opening the file finds them in place (and adds
# none beside them); a body other than these is older and replaced. kv_version_rename is new: older versions
# leave it be.
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
    # This class never renames, another tool may (UPDATE kv SET key = ...): the old name is deleted and the new
    # one put, in one version. Without it the feed saw neither, and a buffer served the old name for up to
    # RECONCILE_INTERVAL (10 minutes; issue 38).
    "kv_version_rename": "CREATE TRIGGER kv_version_rename AFTER UPDATE OF partition_id, key ON kv"
    " WHEN OLD.partition_id IS NOT NEW.partition_id OR OLD.key IS NOT NEW.key BEGIN" + _NEW_VERSION +
    " INSERT OR REPLACE INTO kv_deleted (partition_id, key, version)"
    " VALUES (OLD.partition_id, OLD.key, last_insert_rowid());"
    " UPDATE kv SET version = last_insert_rowid() WHERE partition_id = NEW.partition_id AND key = NEW.key;"
    " DELETE FROM kv_deleted WHERE partition_id = NEW.partition_id AND key = NEW.key; END",
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
    # Deletes another tool removed by hand (DELETE FROM kv_deleted) cannot be served: the horizon moves past them,
    # so a cursor from before gets None. Not the prune's rows (below the horizon), nor the entry of a key put again
    # (stored now: the insert trigger removes it).
    "CREATE TRIGGER IF NOT EXISTS kv_deleted_trimmed AFTER DELETE ON kv_deleted"
    " WHEN OLD.version > (SELECT pruned FROM kv_clock)"
    " AND NOT EXISTS (SELECT 1 FROM kv WHERE partition_id = OLD.partition_id AND key = OLD.key)"
    " BEGIN UPDATE kv_clock SET pruned = OLD.version; END",
)

_NAMES = ("kv_clock", "kv_deleted", "kv_deleted_by_version", "kv_by_version", "kv_versions", "kv_deleted_prune",
          "kv_versions_prune", "kv_deleted_trimmed", *_WRITE_TRIGGERS)

# One read (~4 us): the schema's version; the clock's versions (NULL: no clock row); the version log's last; the
# highest version a row or a deletion holds. The log reaches them all unless another tool emptied it (and perhaps
# wrote into it since, from 1 again). Fails on a table another tool dropped.
_LOG_STATE = ("SELECT (SELECT schema_version FROM pragma_schema_version), (SELECT max(version, pruned) FROM kv_clock),"
              " coalesce((SELECT max(version) FROM kv_versions), -1), max(coalesce((SELECT max(version) FROM kv), 0),"
              " coalesce((SELECT max(version) FROM kv_deleted), 0))")


def _ensure_change_log(conn: sqlite3.Connection) -> None:
    """Make the change log whole (:func:`_mend_change_log`): one read when it is, else one ``BEGIN IMMEDIATE``.

    Processes opening an old file at once migrate it once.
    """
    if _whole(conn):
        return
    with _immediate(conn):
        _mend_change_log(conn)


def _mend_change_log(conn: sqlite3.Connection, *, writing: bool = False) -> None:
    """In a write transaction: add the version column, the clock, the logs and the triggers where missing or older.

    Writers call it too (``writing``: see :func:`_whole`), so a log another tool dropped never fails a put, and a put
    never goes unlogged. Older rows keep their version (0 before the change feed). A file that had a version log,
    and lost a part of it (another tool emptied or dropped a table, or dropped a trigger and wrote meanwhile) or was
    made by an earlier version, cannot tell what went unlogged: a new version is logged and made the horizon, so
    every cursor from before gets None and its poller a full listing.
    """
    if _whole(conn, writing=writing):  # the usual case; or another process mended it while this one waited
        return
    found = _schema(conn)
    had_log = "kv_versions" in found
    columns = {row[1] for row in conn.execute("PRAGMA table_info(kv)")}
    if "version" not in columns:
        conn.execute("ALTER TABLE kv ADD COLUMN version INTEGER NOT NULL DEFAULT 0")
    for statement in _TABLES:
        conn.execute(statement)
    for name, statement in _WRITE_TRIGGERS.items():
        if found.get(name) != statement:
            conn.execute(f"DROP TRIGGER IF EXISTS {name}")
            conn.execute(statement)
    for statement in _TRIGGERS:
        conn.execute(statement)
    if had_log:
        conn.execute(_NEXT_VERSION)
        conn.execute("UPDATE kv_clock SET pruned = (SELECT max(version) FROM kv_versions)")
        logger.info("the change log of this file was incomplete (another tool emptied, dropped or trimmed a part, or "
                    "an earlier version made it): mended; pollers take a full listing")


def _whole(conn: sqlite3.Connection, *, writing: bool = False) -> bool:
    """Whether the change log is whole: this version's schema, the clock's row, and the version log reaching every
    version in use (:data:`_LOG_STATE`, ~4 us; ~10 us at the start of a write transaction).

    The schema itself (~12 us) is read again only when its version moved since this connection last found it whole.
    ``writing``: the schema alone, unless it moved (~1 us; a put of one key costs ~45 us). A write needs no more: in
    a log another tool emptied its version is logged all the same, numbered low, and the next read mends the log.
    """
    if writing and isinstance(conn, _Connection) and conn.log_schema is not None:
        if conn.execute("PRAGMA schema_version").fetchone()[0] == conn.log_schema:
            return True
    try:
        schema, clock, logged, used = conn.execute(_LOG_STATE).fetchone()
    except sqlite3.OperationalError as exc:
        if not str(exc).startswith("no such table"):
            raise
        return False
    if clock is None or logged < max(clock, used):
        return False
    if isinstance(conn, _Connection) and conn.log_schema == schema:
        return True
    found = _schema(conn)
    whole = len(found) == len(_NAMES) and all(found[name] == sql for name, sql in _WRITE_TRIGGERS.items())
    if whole and isinstance(conn, _Connection):
        conn.log_schema = schema
    return whole


def _schema(conn: sqlite3.Connection) -> dict[str, str]:
    """``{name: sql}`` of the change log's tables, indexes and triggers in the file."""
    marks = ",".join("?" * len(_NAMES))
    return dict(conn.execute(f"SELECT name, sql FROM sqlite_master WHERE name IN ({marks})", _NAMES).fetchall())


def _read_snapshot(conn: sqlite3.Connection) -> tuple[Cursor, StoredListing]:
    """Every row and the cursor that follows them, from one read transaction."""
    pieces = _read_snapshot_pieces(conn, 65536)
    cursor = next(pieces)
    listing: StoredListing = {}
    for piece in pieces:
        for partition, items in piece.items():
            listing.setdefault(partition, {}).update(items)
    return cursor, listing


def _read_snapshot_pieces(conn: sqlite3.Connection, size: int) -> Iterator[Any]:
    """The cursor, then every row in listings of at most ``size`` rows, from one read transaction (open till closed)."""
    with _read(conn):
        clock, last = _clock(conn), _last_version(conn)
        # Another tool broke the log since the check: a cursor no change read serves (a full listing next).
        yield (clock[0], *last) if clock is not None and last is not None else _UNSERVED
        yield from fetch_listings(conn, "SELECT partition_id, key, tags FROM kv ORDER BY partition_id, key", size)


def _read_changes(conn: sqlite3.Connection, cursor: Any) -> (
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
        clock = _clock(conn)
        if clock is None or store != clock[0] or since < clock[1]:
            return None
        store_id = clock[0]
        logged = _fetch_one(conn, "SELECT stamp FROM kv_versions WHERE version = ?", (since,))
        if logged is None or logged[0] != stamp:
            return None
        last = _last_version(conn)
        if last is None:  # never: the cursor's version is logged, and this read transaction sees one state
            return None
        upserts = fetch_listing(conn, "SELECT partition_id, key, tags FROM kv WHERE version > ?", (since,))
        gone = fetch_all(conn, "SELECT partition_id, key FROM kv_deleted WHERE version > ?", (since,))
    deletes: dict[Any, list[Any]] = {}
    for partition, key in gone:
        deletes.setdefault(partition, []).append(key)
    return (store_id, *last), upserts, deletes


#: A cursor no change read serves (no file has this store id): the next read is a full listing.
_UNSERVED: Cursor = ("", -1, 0)


def _clock(conn: sqlite3.Connection) -> tuple[str, int] | None:
    """The file's store id and the deletion log's horizon; None if another tool removed the clock."""
    row = _fetch_one(conn, "SELECT store_id, pruned FROM kv_clock")
    return None if row is None else (str(row[0]), int(row[1]))


def _last_version(conn: sqlite3.Connection) -> tuple[int, int] | None:
    """The last version written and its stamp; None if another tool emptied or dropped the version log."""
    row = _fetch_one(conn, "SELECT version, stamp FROM kv_versions ORDER BY version DESC LIMIT 1")
    return None if row is None else (int(row[0]), int(row[1]))


def _fetch_one(conn: sqlite3.Connection, sql: str, params: tuple[Any, ...] = ()) -> Any:
    """The first row of ``sql``, or None: also when another tool dropped its table since the log was checked."""
    try:
        return conn.execute(sql, params).fetchone()
    except sqlite3.OperationalError as exc:
        if not str(exc).startswith("no such table"):
            raise
        return None


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
