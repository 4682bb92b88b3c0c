"""The embedded default store: a key-value store of tags (and JSON fields) in one SQLite file.

It speaks TransferQueue's KV API, so the poller, the demo and the tests need no Ray, torch or controller, and
offers the change feed (:mod:`poller.sources.sqlite_changes`). Any number of processes share a file::

    writer processes ──kv_batch_put──▶ kv.db (WAL) ◀──kv_changes()── poller thread
    trainer ─────────────kv_clear────▶

Built from a spec in any process, so the connection opens on first use, in the process that uses it (anew
after a fork). Fields are JSON only (not tensors), which verl's DAPO metric is.
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

from poller.sources import sqlite_io
from poller.sources.sqlite_changes import Cursor, ensure_change_log, read_changes, read_snapshot, snapshot_pieces

__all__ = ["SqliteSource"]

logger = logging.getLogger(__name__)

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
        with self._connection() as conn, sqlite_io.immediate(conn):
            for table, updates in (("kv", tag_list), ("kv_fields", field_list)):
                if updates is None:
                    continue
                merged = sqlite_io.select_json(conn, partition_id, key_list, table=table)
                for key, update in zip(key_list, updates):
                    merged.setdefault(key, {}).update(update)
                # Values were checked above; dumping cannot fail half-way through.
                conn.executemany(_UPSERTS[table], [(partition_id, key, sqlite_io.dumps(merged[key]))
                                                   for key in dict.fromkeys(key_list)])

    def kv_list(self, partition_id: str | None = None) -> sqlite_io.StoredListing:
        """Everything stored (or only ``partition_id``'s) as fresh ``{partition_id: {key: tags}}`` dicts.

        One ``SELECT``: a consistent snapshot while others write. A row another tool wrote never fails the
        listing (:data:`~poller.sources.sqlite_io.StoredListing`): tags that are no JSON object are an
        :class:`~poller.wire.sources.UnreadableValue`, a BLOB or non-UTF-8 key or partition id ``bytes``.

        Raises:
            TypeError: ``partition_id`` is neither None nor a str.
        """
        if partition_id is not None:
            sqlite_io.check_str("partition_id", partition_id)
        where, params = ("", ()) if partition_id is None else (" WHERE partition_id = ?", (partition_id,))
        with self._connection() as conn:
            rows = sqlite_io.fetch_all(conn, "SELECT partition_id, key, tags FROM kv" + where, params)
        return sqlite_io.listing_of(rows)

    def kv_snapshot(self) -> tuple[Cursor, sqlite_io.StoredListing]:
        """Everything stored, as :meth:`kv_list`, and the change cursor right after it."""
        with self._change_log() as conn:
            return read_snapshot(conn)

    def kv_snapshot_pieces(self, size: int = 4096) -> tuple[Cursor, Iterator[sqlite_io.StoredListing]]:
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
            yield from snapshot_pieces(conn, size)

    def kv_changes(self, cursor: Any) -> tuple[Cursor, sqlite_io.StoredListing, dict[Any, list[Any]]] | None:
        """What was put or cleared after ``cursor``: ``(cursor, upserts, deletes)``, or ``None``.

        ``None``: the cursor is from another file, another history of this one (restored from a backup) or
        older than the pruned logs (:mod:`poller.sources.sqlite_changes`). Rows read as by :meth:`kv_list`.

        Raises:
            TypeError: ``cursor`` did not come from this store.
        """
        with self._change_log() as conn:
            return read_changes(conn, cursor)

    def kv_clear(self, keys: list[str], partition_id: str) -> None:
        """Delete ``keys`` (and their fields) from ``partition_id``; missing keys are fine."""
        sqlite_io.check_str("partition_id", partition_id)
        key_list = sqlite_io.check_keys(keys)
        if not key_list:
            return
        with self._connection() as conn, sqlite_io.immediate(conn):
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
                self._conn = sqlite_io.open_connection(self._path, self._timeout, migrate=ensure_change_log)
                self._conn_pid = pid
                self._conn_file = self._file_id()
            yield self._conn

    @contextmanager
    def _change_log(self) -> Iterator[sqlite3.Connection]:
        """:meth:`_connection`, the change log checked first (cheap): a backup restored in place may predate it."""
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
