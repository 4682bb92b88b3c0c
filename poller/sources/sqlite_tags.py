"""Opening :class:`~poller.sources.sqlite.SqliteSource`'s file, and checking and encoding what it stores.

Tags are stored as JSON text; only what comes back from JSON unchanged is
accepted, so a stored tag never differs from the one put.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["Tags", "check_str", "check_keys", "check_tags", "dump_tags", "load_tags", "open_connection"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

Tags = dict[str, Any]


def check_str(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}: {value!r}")


def check_keys(keys: Any) -> list[str]:
    # A bare str is iterable too; kv_clear("k1", ...) would clear "k" and "1".
    if isinstance(keys, (str, bytes, Mapping)) or not isinstance(keys, Iterable):
        raise TypeError(f"keys must be a list of str, got {type(keys).__name__}")
    key_list = list(keys)
    for index, key in enumerate(key_list):
        if not isinstance(key, str):
            raise TypeError(f"keys[{index}] must be a str, got {type(key).__name__}: {key!r}")
    return key_list


def check_tags(key: str, tags: Any) -> None:
    if not isinstance(tags, dict):
        raise TypeError(f"tags of key {key!r} must be a dict, got {type(tags).__name__}")
    _check_json(tags, f"tags of key {key!r}")


def _check_json(value: Any, where: str) -> None:
    """Refuse what would not come back from JSON unchanged.

    ``json.dumps`` silently turns tuples into lists and int dict keys into
    strings, and writes NaN, which is not JSON; each would make a stored tag
    differ from the one put.
    """
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value!r} cannot be stored as JSON")
        return
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check_json(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{where}: dict key {name!r} is {type(name).__name__}, not str")
            _check_json(item, f"{where}[{name!r}]")
        return
    raise TypeError(f"{where}: {type(value).__name__} {value!r} is not JSON-encodable")


def dump_tags(tags: Tags) -> str:
    return json.dumps(tags, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def load_tags(partition_id: str, key: str, text: str) -> Tags:
    try:
        tags = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"stored tags of {partition_id!r}/{key!r} are not JSON: {exc}") from None
    if not isinstance(tags, dict):
        raise ValueError(f"stored tags of {partition_id!r}/{key!r} are {type(tags).__name__}, not an object")
    return tags


_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kv ("
    " partition_id TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " tags TEXT NOT NULL,"
    " PRIMARY KEY (partition_id, key)"
    ") WITHOUT ROWID"
)


def open_connection(path: str, timeout: float,
                    migrate: Callable[[sqlite3.Connection], None] | None = None) -> sqlite3.Connection:
    """A connection to ``path`` in WAL mode with the schema, then ``migrate(conn)``, retrying a busy file."""
    directory = os.path.dirname(os.path.abspath(path))
    if path != ":memory:" and not path.startswith("file:"):
        os.makedirs(directory, exist_ok=True)
    # isolation_level=None: the sqlite3 module must not open transactions
    # behind our back; _transaction() issues BEGIN/COMMIT itself.
    # check_same_thread=False: the poller calls kv_list() from a helper
    # thread; self._lock serializes all use.
    conn = sqlite3.connect(path, timeout=timeout, isolation_level=None,
                           check_same_thread=False, uri=path.startswith("file:"))
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
        # WAL lets kv_list() read while a writer holds the lock; the mode
        # is stored in the file, so only the first opener changes it.
        mode = _retry_busy(timeout, lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        if mode != "wal":
            logger.debug("%s: journal_mode is %s, not wal", path, mode)
        # NORMAL is durable against process crashes in WAL mode; only a
        # power loss can drop the last transactions, which a replay
        # buffer's metadata can afford.
        conn.execute("PRAGMA synchronous = NORMAL")
        _retry_busy(timeout, lambda: conn.execute(_SCHEMA))
        if migrate is not None:
            _retry_busy(timeout, lambda: migrate(conn))
    except BaseException:
        conn.close()
        raise
    logger.debug("opened %s (pid %d)", path, os.getpid())
    return conn


def _retry_busy(timeout: float, call: Callable[[], _T]) -> _T:
    """Run ``call``, retrying "database is locked" until ``timeout`` seconds pass.

    Switching a fresh file to WAL needs an exclusive lock and SQLite does
    not run the busy handler for it: with several processes opening a new
    file at once, some got SQLITE_BUSY at once (7 of 200 trials with 6
    processes) instead of waiting.
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
