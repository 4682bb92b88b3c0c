"""Store faults: what can happen to the embedded SQLite file under a running poller.

Each acts on the file at ``path`` from outside, the way an operator, a full
disk or a second program would: :func:`delete` removes it (and its WAL and
shared-memory files), :func:`lock` holds its write lock, :func:`corrupt`
overwrites it with noise, :func:`restore` rolls it back to a :func:`backup`
in place. Another tool sharing the file writes rows the store cannot read
(:func:`write_unreadable`, one of :data:`UNREADABLE`) and replaces a key in
one transaction (:func:`replace`), with plain :mod:`sqlite3`.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
from contextlib import closing, contextmanager
from typing import Any, Iterator

__all__ = ["delete", "lock", "corrupt", "backup", "restore", "UNREADABLE", "write_unreadable", "delete_unreadable",
           "replace"]

_SIDE_FILES = ("", "-wal", "-shm")


def delete(path: str) -> None:
    """Remove the database and its side files, as ``rm kv.db*`` would."""
    for suffix in _SIDE_FILES:
        try:
            os.remove(path + suffix)
        except FileNotFoundError:
            pass


@contextmanager
def lock(path: str) -> Iterator[None]:
    """Hold the database's write lock for the block, as a stuck writer would.

    Writers then wait their ``timeout`` and fail with "database is locked".
    In WAL mode readers (the poller's ``kv_list()``) go on: a lock that
    blocks them too cannot be had while any other connection is open.
    """
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()


def corrupt(path: str, seed: int = 0) -> None:
    """Overwrite the database, its WAL and its shared-memory index with seeded noise.

    The index is what open connections consult to see whether their cached
    pages are still good: with it overwritten too they notice at once, as
    they would after a torn write by another process.
    """
    rng = random.Random(seed)
    for suffix in _SIDE_FILES:
        try:
            size = os.path.getsize(path + suffix)
        except FileNotFoundError:
            continue
        with open(path + suffix, "r+b") as f:
            f.write(rng.randbytes(max(size, 4096)))


def backup(path: str, target: str) -> None:
    """Copy the database to ``target`` with SQLite's backup API, as sqlite3's ``.backup`` does."""
    _copy(path, target)


def restore(path: str, backup: str) -> None:
    """Roll the database back to ``backup`` in place (the same file, its store id, an older history).

    SQLite's backup API writes ``backup``'s pages into the open file, as
    sqlite3's ``.restore`` does; connections already open see the old
    content at their next read.
    """
    _copy(backup, path)


def _copy(source: str, target: str) -> None:
    with closing(sqlite3.connect(source)) as src, closing(sqlite3.connect(target)) as dst:
        src.backup(dst)


# Rows another tool sharing the file may write that the store cannot read: kind -> (key, tags) as SQL.
UNREADABLE: dict[str, tuple[str, str]] = {
    "tags-not-json": ("'bad'", "'not json'"),
    "tags-not-an-object": ("'bad'", "'[1, 2]'"),
    "tags-not-utf8": ("'bad'", "CAST(X'7b22ff227d' AS TEXT)"),
    "key-not-utf8": ("CAST(X'6b6579ff' AS TEXT)", "'{}'"),  # b"key\xff": TEXT that is not UTF-8
    "blob-key": ("X'626c6f62'", "'{}'"),  # b"blob": a BLOB in the TEXT column
    # Valid JSON, nested past what the JSON decoder can read (it raises RecursionError, not ValueError). The
    # decoder's limit is the interpreter's: ~1,000 levels up to 3.11, ~10,000 from 3.12; 100,000 is past both.
    "tags-nested-too-deep": ("'bad'", "'{\"deep\": " + "[" * 100_000 + "]" * 100_000 + "}'"),
}


def write_unreadable(path: str, partition: str, kind: str) -> None:
    """Insert a row of ``kind`` (one of :data:`UNREADABLE`) into ``partition``, as another tool would."""
    key, tags = _unreadable(kind)
    _execute(path, f"INSERT INTO kv (partition_id, key, tags) VALUES (?, {key}, {tags})", partition)


def delete_unreadable(path: str, partition: str, kind: str) -> None:
    """Delete the row :func:`write_unreadable` wrote for ``kind``, as the tool that wrote it would."""
    key, _ = _unreadable(kind)
    _execute(path, f"DELETE FROM kv WHERE partition_id = ? AND key = {key}", partition)


def replace(path: str, partition: str, key: str, tags: dict[str, Any]) -> None:
    """Clear ``key`` and put it again with ``tags`` in one transaction: no listing can see it absent."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM kv WHERE partition_id = ? AND key = ?", (partition, key))
        conn.execute("INSERT INTO kv (partition_id, key, tags) VALUES (?, ?, ?)", (partition, key, json.dumps(tags)))
        conn.execute("COMMIT")


def _unreadable(kind: str) -> tuple[str, str]:
    if kind not in UNREADABLE:
        raise ValueError(f"kind must be one of {', '.join(UNREADABLE)}; got {kind!r}")
    return UNREADABLE[kind]


def _execute(path: str, sql: str, *params: object) -> None:
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(sql, params)
