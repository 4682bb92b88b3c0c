"""The SQLite store's rows, for :mod:`poller.sources.sqlite`: read whatever wrote them, checked and encoded when put.

A read is one call here, the rows fetched and parsed (:func:`fetch_listing`, :func:`fetch_listings`; or fetched
under a lock and parsed by :func:`listing_of` once it is released): TEXT that is not UTF-8 comes as bytes (a fetch
that fails on it would lose every later row), tags that are no JSON object an UnreadableValue. A put accepts only
values that come back from JSON unchanged (:func:`check_json`).
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from poller.wire.vocabulary import Tags, UnreadableValue

logger = logging.getLogger(__name__)

#: ``{partition_id: {key: tags}}`` as the file holds it: a partition id or key another tool wrote as a BLOB
#: or non-UTF-8 text is ``bytes``, tags that are no JSON object an UnreadableValue.
StoredListing = dict[Any, dict[Any, "Tags | UnreadableValue"]]


# Stay well below SQLITE_MAX_VARIABLE_NUMBER (999 on old builds) in IN (...).
_SELECT_CHUNK = 500


def select_json(conn: sqlite3.Connection, partition_id: str, keys: list[str], table: str = "kv") -> dict[str, Tags]:
    """Stored tags (or, from ``kv_fields``, fields) of those ``keys`` that exist.

    Raises:
        ValueError: a stored value cannot be read (:func:`read_tags`), naming the key and why.
    """
    column = "tags" if table == "kv" else "fields"
    found: dict[str, Tags] = {}
    key_list = list(dict.fromkeys(keys))
    for start in range(0, len(key_list), _SELECT_CHUNK):
        chunk = key_list[start:start + _SELECT_CHUNK]
        marks = ",".join("?" * len(chunk))
        rows = fetch_all(conn, f"SELECT key, {column} FROM {table} WHERE partition_id = ? AND key IN ({marks})",
                         (partition_id, *chunk))
        for key, text in rows:
            tags = read_tags(text)
            if isinstance(tags, UnreadableValue):
                raise ValueError(tags.reason.replace("stored tags", f"stored tags of {partition_id!r}/{key!r}", 1))
            found[key] = tags
    return found


def fetch_listing(conn: sqlite3.Connection, sql: str, params: Sequence[Any] = ()) -> StoredListing:
    """The ``(partition_id, key, tags)`` rows of ``sql`` as ``{partition_id: {key: tags}}`` (:func:`fetch_all`)."""
    return listing_of(fetch_all(conn, sql, params))


def fetch_listings(conn: sqlite3.Connection, sql: str, size: int) -> Iterator[StoredListing]:
    """:func:`fetch_listing` in listings of at most ``size`` rows, each parsed when taken (:func:`fetch_batches`)."""
    return map(listing_of, fetch_batches(conn, sql, size))


def listing_of(rows: Iterable[Any]) -> StoredListing:
    """``{partition_id: {key: tags}}`` of ``(partition_id, key, tags)`` rows, each read by :func:`read_tags`."""
    listing: StoredListing = {}
    for partition, key, text in rows:
        listing.setdefault(partition, {})[key] = read_tags(text)
    return listing


def fetch_all(conn: sqlite3.Connection, sql: str, params: Sequence[Any] = ()) -> list[Any]:
    """Every row of ``sql``; a TEXT value that is not UTF-8 comes as its bytes (see :func:`fetch_batches`)."""
    try:
        return conn.execute(sql, params).fetchall()
    except sqlite3.OperationalError as exc:
        if not _undecodable(exc):
            raise
    with _text_as_bytes_where_not_utf8(conn):
        return conn.execute(sql, params).fetchall()


def fetch_batches(conn: sqlite3.Connection, sql: str, size: int) -> Iterator[list[Any]]:
    """The rows of ``sql`` in lists of at most ``size``; a TEXT value that is not UTF-8 comes as its bytes.

    Such a value fails sqlite3's fetch and every row after it, and a ``text_factory`` keeping it as bytes is slow
    (~0.3 s per 1M keys): rows are read in C until one fails, then with that factory, skipping those given.
    ``sql`` must order its rows and run in one read transaction, so both reads agree.
    """
    given = 0
    rows = None
    try:
        rows = conn.execute(sql)  # Python 3.10 reads the first row here already
        while batch := rows.fetchmany(size):
            given += len(batch)
            yield batch
        return
    except sqlite3.OperationalError as exc:
        if not _undecodable(exc):
            raise
    logger.debug("a TEXT value is not UTF-8; reading the rest with bytes for such values")
    if rows is not None:
        rows.close()  # Python 3.10 reuses its statement for the read below: left open, a row would come twice
    with _text_as_bytes_where_not_utf8(conn):
        rows = conn.execute(sql)
        while given > 0:
            given -= len(rows.fetchmany(min(given, size)))
        while batch := rows.fetchmany(size):
            yield batch


def _undecodable(exc: sqlite3.OperationalError) -> bool:
    """Whether sqlite3 raised ``exc`` because a TEXT value is not UTF-8 (the wording CPython's own tests pin)."""
    return str(exc).startswith("Could not decode to UTF-8")


def _text_or_bytes(data: bytes) -> str | bytes:
    try:
        return data.decode()
    except UnicodeDecodeError:
        return data


@contextmanager
def _text_as_bytes_where_not_utf8(conn: sqlite3.Connection) -> Iterator[None]:
    conn.text_factory = _text_or_bytes
    try:
        yield
    finally:
        conn.text_factory = str


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


def json_rows(what: str, keys: list[str], given: Any) -> list[Tags]:
    """``tags`` or ``fields`` of kv_batch_put as one checked dict per key (fields: or columns ``{name: [values]}``)."""
    if what == "fields" and isinstance(given, Mapping):
        rows: list[Tags] = [{} for _ in keys]
        for name, column in dict(given).items():
            check_str("field name", name)
            if isinstance(column, (str, bytes, Mapping)) or not isinstance(column, Iterable):
                raise TypeError(f"field {name!r} must be a list with one value per key, got {type(column).__name__}")
            values = list(column)
            if len(values) != len(keys):
                raise ValueError(f"field {name!r} has {len(values)} values for {len(keys)} keys")
            for row, value in zip(rows, values):
                row[name] = value
    elif isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Iterable):
        shapes = "a list of dicts or a dict of columns" if what == "fields" else "a list of dicts"
        raise TypeError(f"{what} must be {shapes}, got {type(given).__name__}")
    else:
        rows = list(given)
        if len(rows) != len(keys):
            raise ValueError(f"got {len(rows)} {'tags' if what == 'tags' else 'field rows'} for {len(keys)} keys")
    for key, row in zip(keys, rows):
        if not isinstance(row, dict):
            raise TypeError(f"{what} of key {key!r} must be a dict, got {type(row).__name__}")
        try:
            check_json(row, f"{what} of key {key!r}")
        except RecursionError:
            raise ValueError(f"{what} of key {key!r} nest too deep to be stored as JSON") from None
    return rows


def check_json(value: Any, where: str) -> None:
    """Refuse what would not come back from JSON unchanged, so what a reader gets equals what was put.

    ``json.dumps`` silently turns tuples into lists and int dict keys into strings, and writes NaN (no JSON).
    """
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value!r} cannot be stored as JSON")
        return
    if isinstance(value, list):
        for index, item in enumerate(value):
            check_json(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{where}: dict key {name!r} is {type(name).__name__}, not str")
            check_json(item, f"{where}[{name!r}]")
        return
    raise TypeError(f"{where}: {type(value).__name__} {value!r} is not JSON-encodable")


def dumps(tags: Tags) -> str:
    """``tags`` as the store writes them.

    Raises:
        ValueError: they nest too deep for the encoder (stored tags merged with a put, each read at its limit).
    """
    try:
        return json.dumps(tags, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except RecursionError:
        raise ValueError("the merged tags nest too deep to be stored as JSON") from None


# A row this module wrote has no surrounding whitespace for json.loads to check: raw_decode reads
# it ~40% faster. Any other text goes to json.loads, which decides and words its error.
_raw_decode = json.JSONDecoder().raw_decode


def read_tags(text: Any) -> Tags | UnreadableValue:
    """A stored tags (or fields) value as a dict, or an :class:`~poller.wire.vocabulary.UnreadableValue` saying why not.

    A BLOB holding a JSON object in UTF-8 is read.
    """
    if type(text) is str:
        try:
            value, end = _raw_decode(text)
            if end == len(text) and type(value) is dict:
                return value
        except ValueError:
            pass
        except RecursionError:  # valid JSON nested ~1000 deep: the row's problem, never the read's (issue 38)
            return _too_deep()
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError as exc:
            return UnreadableValue(f"stored tags are not UTF-8 text ({exc})")
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as exc:
        return UnreadableValue(f"stored tags are not JSON: {exc}")
    except RecursionError:
        return _too_deep()
    if not isinstance(value, dict):
        return UnreadableValue(f"stored tags are {type(value).__name__}, not an object")
    return value


def _too_deep() -> UnreadableValue:
    # The C decoder recurses once per level: JSON nested past the interpreter's limit (~1,000 levels up to
    # Python 3.11, ~10,000 from 3.12) raises RecursionError, which is no ValueError; uncaught, it failed every
    # listing of the store and ended the poller.
    return UnreadableValue("stored tags nest deeper than JSON can be read by this interpreter's decoder")
