"""Store faults: what can happen to the embedded SQLite file under a running poller.

Each acts on the file at ``path`` from outside, the way an operator, a full
disk or a second program would: :func:`delete` removes it (and its WAL and
shared-memory files), :func:`lock` holds an exclusive lock that blocks every
reader, :func:`corrupt` overwrites it with noise.
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
    """Hold the database exclusively for the block: readers and writers get "database is locked".

    In WAL mode a plain write lock lets readers go on; ``locking_mode =
    EXCLUSIVE`` with a write keeps everyone else out until it is released.
    """
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
    try:
        conn.execute("PRAGMA locking_mode = EXCLUSIVE")
        conn.execute("BEGIN EXCLUSIVE")
        conn.execute("CREATE TABLE IF NOT EXISTS _fault_lock (x)")
        yield
        conn.execute("ROLLBACK")
    finally:
        conn.close()


def corrupt(path: str, seed: int = 0) -> None:
    """Overwrite the database and its WAL with seeded noise (at least one page each)."""
    rng = random.Random(seed)
    for suffix in ("", "-wal"):
        try:
            size = os.path.getsize(path + suffix)
        except FileNotFoundError:
            continue
        with open(path + suffix, "r+b") as f:
            f.write(rng.randbytes(max(size, 4096)))
