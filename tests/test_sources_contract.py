"""The source contract (poller.sources.contract): one Protocol per capability, checked once when a source is
loaded, what it offers then read from one record. The packed-listing rule: tests/test_tq_packed.py; a
malformed source failing a real poller's start-up: tests/test_lifecycle.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from buffer.verl.link import _open_client
from poller.faults import slow
from poller.sources.contract import (
    ChangeFeed,
    Source,
    capabilities,
    load_source,
    resolve_spec,
)
from poller.sources.sqlite import SqliteSource
from tests.helpers.sources import HalfChangeFeed, ListedSqlite, WatchedSqlite


class _Lists:
    def kv_list(self) -> Any:
        return {}


class _SnapshotOnly(_Lists):
    def kv_snapshot(self) -> Any:
        return None, {}


class _PiecesOnly(_Lists):
    def kv_snapshot_pieces(self) -> Any:
        return None, iter(())


class _WatchNotCallable(_Lists):
    kv_watch = 3


class _FeedAndWatch(_Lists):
    def kv_snapshot(self) -> Any:
        return None, {}

    def kv_changes(self, cursor: Any) -> Any:
        return None

    def kv_watch(self, partition_id: str, keys: Any, timeout: float) -> Any:
        return None


@pytest.mark.parametrize("source, match", [
    (HalfChangeFeed(), "offers kv_changes but a change feed needs kv_snapshot and kv_changes"),
    (_SnapshotOnly(), "offers kv_snapshot but a change feed needs"),
    (_PiecesOnly(), "offers kv_snapshot_pieces but a change feed needs"),
    (_WatchNotCallable(), "has kv_watch, which is not callable"),
    (object(), "has no kv_list"),
])
def test_a_malformed_source_is_refused_naming_what_is_wrong(source: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        capabilities(source)
    with pytest.raises(TypeError, match=match):
        load_source(source if hasattr(source, "kv_list") else (lambda: source))


class _ClosableHalfFeed(HalfChangeFeed):
    closed = 0

    def close(self) -> None:
        type(self).closed += 1


def test_a_source_built_and_refused_at_load_is_closed() -> None:
    with pytest.raises(TypeError, match="change feed needs"):
        load_source(_ClosableHalfFeed)
    assert _ClosableHalfFeed.closed == 1
    ready_made = _ClosableHalfFeed()
    with pytest.raises(TypeError, match="change feed needs"):
        load_source(ready_made)
    assert _ClosableHalfFeed.closed == 1  # not built here: the caller's to close


def test_load_names_the_spec_of_a_malformed_source() -> None:
    with pytest.raises(TypeError, match=r"source tests\.helpers\.sources:HalfChangeFeed: 'HalfChangeFeed' offers"):
        load_source("tests.helpers.sources:HalfChangeFeed")


def test_what_each_source_offers_is_read_from_one_record(tmp_path: Path) -> None:
    store = SqliteSource(tmp_path / "kv.db")
    try:
        loaded = load_source("poller.sources.sqlite:SqliteSource", {"path": str(tmp_path / "kv.db")})
        offered = capabilities(loaded)
        assert isinstance(loaded, SqliteSource) and offered.change_feed
        assert offered.kv_list_packed is None and offered.kv_watch is None
        assert offered.kv_snapshot_pieces is not None and offered.kv_changes == loaded.kv_changes
        loaded.close()
        assert isinstance(store, ChangeFeed)
        assert capabilities(store).change_feed and capabilities(store).kv_watch is None
        with pytest.raises(AttributeError):
            offered.kv_watch = store.kv_list  # type: ignore[misc]  # a frozen record
    finally:
        store.close()
    listed = ListedSqlite(str(tmp_path / "listed.db"))
    watched = WatchedSqlite(str(tmp_path / "watched.db"))
    try:
        assert not capabilities(listed).change_feed and capabilities(listed).kv_watch is None
        assert capabilities(listed).kv_list == listed.kv_list
        assert capabilities(watched).kv_watch == watched.kv_watch
    finally:
        listed.close()
        watched.close()
    # A change feed says what changed already: its source is not watched.
    assert capabilities(_FeedAndWatch()).kv_watch is None
    # A fault wrapper offers kv_list alone: listed in full, whatever its inner store offers.
    fault = slow(seconds=0.0)
    offered = capabilities(fault)
    assert not offered.change_feed and offered.kv_watch is None and offered.kv_list_packed is None


def test_the_trainers_store_calls_are_named(tmp_path: Path) -> None:
    # buffer.verl opens its store client (StoreClient, or FieldReads for DAPO's metric filter) this way.
    for need_fields in (True, False):
        store, owned = _open_client("poller.sources.sqlite:SqliteSource", {"path": str(tmp_path / "kv.db")},
                                    need_fields)
        assert owned and isinstance(store, SqliteSource) and isinstance(store, Source)
        store.close()
    with pytest.raises(TypeError, match="which has no kv_clear or kv_batch_get: the sampler clears keys and reads"):
        _open_client(_Lists, None, need_fields=True)
    with pytest.raises(TypeError, match="which has no kv_clear: the sampler clears keys through it"):
        _open_client(_Lists, None, need_fields=False)


def test_resolve_spec_names_without_calling() -> None:
    assert resolve_spec("poller.sources.sqlite:SqliteSource") is SqliteSource
    with pytest.raises(ValueError, match="not of the form"):
        resolve_spec("poller.sources.sqlite")
