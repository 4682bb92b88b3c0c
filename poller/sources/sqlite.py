"""The embedded default store: a tags-only key-value store in one SQLite file.

It speaks TransferQueue's KV API (``kv_put``, ``kv_batch_put``, ``kv_list``,
``kv_clear``) so that the poller, the demo and the tests need no Ray, no
torch and no running controller. Any number of processes may use the same
file at once::

    writer processes ──kv_batch_put──▶ kv.db (WAL) ◀──kv_list()── poller thread
    trainer ─────────────kv_clear────▶

The poller builds it from the spec ``"poller.sources.sqlite:SqliteSource"``
with ``{"path": ...}``, so the constructor only records its arguments: the
connection is opened on first use, in the process (and after a fork, anew in
the child) that uses it.

Tags live in one table, ``fields`` (TransferQueue's per-key payload) in a
second one, as JSON: only JSON values can be stored there (not tensors),
which is what verl's DAPO metric, ``extra_fields.reward_extra_info``, is.
``kv_batch_get`` reads them back.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from poller.sources.sqlite_changes import Cursor, ensure_change_log, read_changes, read_snapshot, snapshot_pieces
from poller.sources.sqlite_io import StoredListing, open_connection
from poller.sources.sqlite_io import check_keys as _check_keys
from poller.sources.sqlite_io import check_str as _check_str
from poller.sources.sqlite_io import dumps as _dumps
from poller.sources.sqlite_io import fetch_all as _fetch_all
from poller.sources.sqlite_io import field_rows as _field_rows
from poller.sources.sqlite_io import read_tags as _read_tags
from poller.sources.sqlite_io import select_json as _select_json
from poller.sources.sqlite_io import tag_rows as _tag_rows

__all__ = ["SqliteSource"]

logger = logging.getLogger(__name__)

_FIELDS_UPSERT = (
    "INSERT INTO kv_fields (partition_id, key, fields) VALUES (?, ?, ?)"
    " ON CONFLICT (partition_id, key) DO UPDATE SET fields = excluded.fields"
)

_UPSERT = (
    "INSERT INTO kv (partition_id, key, tags) VALUES (?, ?, ?)"
    " ON CONFLICT (partition_id, key) DO UPDATE SET tags = excluded.tags"
)

# Connections inherited through fork() are parked here and never touched
# again: SQLite forbids using a connection across fork, and closing one in the
# child counts as use (it may checkpoint or delete the parent's WAL file).
_INHERITED: list[sqlite3.Connection] = []


def _started(pieces: Generator[Any, None, None]) -> tuple[Cursor, Iterator[Any]]:
    """The cursor a snapshot generator yields first, and the generator, positioned at its first listing."""
    try:
        return next(pieces), pieces
    except BaseException:
        pieces.close()
        raise


class SqliteSource:
    """A key-value store of ``{partition_id: {key: tags}}`` in a SQLite file.

    Safe to share between processes (each opens its own connection, WAL mode
    lets readers run alongside one writer) and between the threads of one
    process (one connection per instance, guarded by a lock). Every
    read-modify-write runs in a ``BEGIN IMMEDIATE`` transaction, so merges
    from concurrent processes never lose each other's tags.

    Args:
        path: the database file; it (and its directory) is created on first
            use if missing.
        timeout: seconds to wait for another process's write lock before
            raising :class:`sqlite3.OperationalError` ("database is locked").

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
        """Store one key, merging ``tag`` into the tags it already has.

        Merging is ``dict.update`` on the top level: keys in ``tag`` replace
        the stored ones, the others stay. A missing key is created with
        ``tag or {}``.

        Args:
            key: the key.
            partition_id: its partition.
            fields: ``{name: value}`` merged into the key's stored fields
                (values must be JSON); ``None`` leaves them alone.
            tag: tags to merge in; ``None`` leaves existing tags unchanged.

        Raises:
            TypeError: ``key`` or ``partition_id`` is not a str, or ``tag``
                is not a dict with str keys and JSON values.
            ValueError: ``tag`` holds a value JSON cannot carry (e.g. NaN).
            sqlite3.OperationalError: the write lock was not had in time.
        """
        _check_str("key", key)
        if fields is not None and not isinstance(fields, Mapping):
            raise TypeError(f"fields must be a dict of field name -> value, got {type(fields).__name__}")
        self.kv_batch_put([key], partition_id, None if fields is None else [dict(fields)],
                          None if tag is None else [tag])

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: Any = None,
                     tags: list[dict[str, Any]] | None = None) -> None:
        """Store many keys in one transaction, merging each key's tags.

        Either every key is written or none is. A key listed twice gets both
        updates, in order.

        Args:
            keys: the keys.
            partition_id: their partition.
            fields: one ``{name: value}`` dict per key, or columns
                ``{name: [value per key]}`` (the shape of TransferQueue's
                TensorDict); merged as in :meth:`kv_put`.
            tags: one dict per key, merged as in :meth:`kv_put`; ``None``
                means ``{}`` for each.

        Raises:
            TypeError: a key, the partition id or a tag has the wrong type.
            ValueError: ``len(tags) != len(keys)``, a tag value JSON
                cannot carry, or a key's stored tags or fields cannot be read
                (another tool wrote them, :meth:`kv_list`): there is nothing
                to merge into, and nothing is written.
            sqlite3.OperationalError: the write lock was not had in time.
        """
        _check_str("partition_id", partition_id)
        key_list = _check_keys(keys)
        tag_list = _tag_rows(key_list, tags)
        field_list = None if fields is None else _field_rows(key_list, fields)
        if not key_list:
            return
        with self._transaction() as conn:
            merged = _select_json(conn, partition_id, key_list)
            for key, tag in zip(key_list, tag_list):
                merged.setdefault(key, {}).update(tag)
            # Values were checked above; dumping cannot fail half-way through.
            conn.executemany(_UPSERT, [(partition_id, key, _dumps(merged[key])) for key in dict.fromkeys(key_list)])
            if field_list is not None:
                stored = _select_json(conn, partition_id, key_list, table="kv_fields")
                for key, row in zip(key_list, field_list):
                    stored.setdefault(key, {}).update(row)
                conn.executemany(_FIELDS_UPSERT, [(partition_id, key, _dumps(stored[key]))
                                                  for key in dict.fromkeys(key_list)])

    def kv_list(self, partition_id: str | None = None) -> StoredListing:
        """Everything stored, as ``{partition_id: {key: tags}}``.

        One ``SELECT``, so the result is a consistent snapshot even while
        other processes write. Partitions without keys do not appear.

        Every row is listed, also one another tool wrote that this class
        would not: tags that are no JSON object (not JSON, JSON of another
        type, TEXT that is not UTF-8) are an
        :class:`~poller.wire.sources.UnreadableValue` naming why, in place of the
        tags dict; a key or partition id that is a BLOB or TEXT that is not
        UTF-8 is ``bytes``. Such a row never fails the listing (a poller
        quarantines it alone); check for it where a row may come from
        elsewhere.

        Args:
            partition_id: list only this partition (``{}`` if it is empty).

        Returns:
            Fresh dicts, safe for the caller to change (:data:`~poller.sources.sqlite_io.StoredListing`).

        Raises:
            TypeError: ``partition_id`` is neither None nor a str.
        """
        if partition_id is not None:
            _check_str("partition_id", partition_id)
        with self._connection() as conn:
            if partition_id is None:
                rows = _fetch_all(conn, "SELECT partition_id, key, tags FROM kv")
            else:
                rows = _fetch_all(conn, "SELECT partition_id, key, tags FROM kv WHERE partition_id = ?",
                                  (partition_id,))
        listing: StoredListing = {}
        for partition, key, text in rows:
            listing.setdefault(partition, {})[key] = _read_tags(text)
        return listing

    def kv_snapshot(self) -> tuple[Cursor, StoredListing]:
        """Everything stored and the change cursor it corresponds to (see :class:`~poller.wire.sources.ChangeFeed`).

        Rows another tool wrote are listed as by :meth:`kv_list`.
        """
        with self._change_log() as conn:
            return read_snapshot(conn)

    def kv_snapshot_pieces(self, size: int = 4096) -> tuple[Cursor, Iterator[StoredListing]]:
        """:meth:`kv_snapshot` read in listings of at most ``size`` rows, each parsed only when it is taken.

        A poller sends each piece while the next is read, so a store of a
        million keys is applied by the trainer as it is read instead of after
        (the JSON parsing is most of a listing's ~5 s). Every piece comes from
        the one read transaction the cursor belongs to, which stays open, and
        this store's lock held, until the iterator is exhausted or closed:
        the caller must ``close()`` it when it stops early.
        """
        return _started(self._snapshot_pieces(size))

    def _snapshot_pieces(self, size: int) -> Generator[Any, None, None]:
        with self._change_log() as conn:
            yield from snapshot_pieces(conn, size)

    def kv_changes(self, cursor: Any) -> tuple[Cursor, StoredListing, dict[Any, list[Any]]] | None:
        """What was put or cleared after ``cursor``: ``(cursor, upserts, deletes)``, or ``None``.

        ``None`` means the cursor is from another file (the store was
        deleted or replaced) or another history of this one (restored from
        a backup), or older than the pruned logs: take :meth:`kv_snapshot`
        instead. See :mod:`poller.sources.sqlite_changes`.
        Rows another tool wrote are listed as by :meth:`kv_list` (a deleted
        key too: ``bytes`` where it was not UTF-8 text).

        Raises:
            TypeError: ``cursor`` did not come from this store.
        """
        with self._change_log() as conn:
            return read_changes(conn, cursor)

    def kv_clear(self, keys: list[str], partition_id: str) -> None:
        """Delete ``keys`` from ``partition_id``; missing keys are fine.

        Raises:
            TypeError: a key or the partition id is not a str.
            sqlite3.OperationalError: the write lock was not had in time.
        """
        _check_str("partition_id", partition_id)
        key_list = _check_keys(keys)
        if not key_list:
            return
        with self._transaction() as conn:
            rows = [(partition_id, key) for key in key_list]
            conn.executemany("DELETE FROM kv WHERE partition_id = ? AND key = ?", rows)
            conn.executemany("DELETE FROM kv_fields WHERE partition_id = ? AND key = ?", rows)

    def kv_batch_get(self, keys: list[str], partition_id: str,
                     select_fields: list[str] | str | None = None) -> dict[str, list[Any]]:
        """The stored fields of ``keys``, as columns ``{name: [value per key]}`` in the order of ``keys``.

        Args:
            keys: keys that must exist in ``partition_id``.
            partition_id: their partition.
            select_fields: the fields to read (a name or a list); ``None``:
                every field any of the keys has. A key without a field
                gets ``None`` in that column.

        Raises:
            TypeError: a key, the partition id or a field name is not a str.
            KeyError: some keys are not stored (the first few are named).
            ValueError: a key's stored tags or fields cannot be read (another
                tool wrote them), naming the key.
        """
        _check_str("partition_id", partition_id)
        key_list = _check_keys(keys)
        names = None if select_fields is None else _check_keys([select_fields] if isinstance(select_fields, str)
                                                               else select_fields)
        with self._connection() as conn:
            present = _select_json(conn, partition_id, key_list)
            stored = _select_json(conn, partition_id, key_list, table="kv_fields")
        missing = [key for key in key_list if key not in present]
        if missing:
            raise KeyError(f"{len(missing)} key(s) not stored in partition {partition_id!r}: {missing[:5]}")
        if names is None:
            names = list(dict.fromkeys(name for key in key_list for name in stored.get(key, {})))
        return {name: [stored.get(key, {}).get(name) for key in key_list] for name in names}

    def close(self) -> None:
        """Close this instance's connection. Idempotent.

        A later call on this instance opens a new connection.
        """
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
        # After a fork the lock may be held by a parent thread that does not
        # exist in the child, so a child starts with a fresh one.
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
                self._conn = open_connection(self._path, self._timeout, migrate=ensure_change_log)
                self._conn_pid = pid
                self._conn_file = self._file_id()
            yield self._conn

    @contextmanager
    def _change_log(self) -> Iterator[sqlite3.Connection]:
        """:meth:`_connection`, its file's change log checked first.

        A file restored in place from a backup made before this version's
        log (or edited by hand) is the same file to :meth:`_check_file`, so
        each read of the change feed checks the log (one read of the schema,
        ~15 us) and migrates it again where needed.
        """
        with self._connection() as conn:
            ensure_change_log(conn)
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
        """Drop a connection whose file was deleted or replaced since it was opened.

        SQLite keeps reading an unlinked file through its open descriptor:
        without this check a deleted store would go on listing its old rows
        forever while writers fill a new file at the same path.

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

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """A ``BEGIN IMMEDIATE`` transaction: committed on success, else rolled back.

        IMMEDIATE takes the write lock up front, so the read of a
        read-modify-write cannot go stale before the write (a DEFERRED
        transaction would fail with SQLITE_BUSY on upgrade instead of waiting).
        """
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                # Also after a failed COMMIT: a transaction left open would
                # make every later BEGIN on this connection fail.
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:  # SQLite may already have rolled back (e.g. on SQLITE_FULL)
                    pass
                raise
