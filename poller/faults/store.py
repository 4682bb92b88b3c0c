"""Store faults: what can happen to the embedded SQLite file under a running poller.

Each acts on the file at ``path`` from outside, the way an operator, a full
disk or a second program would: :func:`delete` removes it (and its WAL and
shared-memory files), :func:`lock` holds its write lock, :func:`corrupt`
overwrites it with noise.
"""

from __future__ import annotations

import os
import random
import sqlite3
from contextlib import contextmanager
from typing import Iterator

__all__ = ["delete", "lock", "corrupt"]

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
