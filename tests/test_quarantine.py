"""One record the wire cannot carry is the record's problem, never the stream's.

A real poller lists a real SQLite store (with its change feed) holding a key
whose tags the receiver's decoder would refuse. Before, the poller failed
every poll on it and the buffer raised PollerCrashed ~15 s later, for good
(and again on every restart while the record was stored). Now the key is
quarantined: named, counted, left out, and every other key flows.
"""

from __future__ import annotations

import logging
import sqlite3

import pytest

from buffer import ReplayBuffer
from buffer.verl import ReplayBuffer as VerlSampler
from poller.faults.shapes import nested
from poller.faults.store import UNREADABLE, delete_unreadable, write_unreadable
from poller.quarantine import Quarantine
from poller.sources.sqlite import SqliteSource
from poller.wire.tags import Refused
from tests.conftest import wait_until

SQLITE = "poller.sources.sqlite:SqliteSource"


BAD_TAGS = {
    "a 2 MB string": ({"global_steps": 1, "status": "success", "text": "x" * (2 * 1024 * 1024)},
                      "exceeds max_str_len"),
    "nested 40 deep": ({"global_steps": 1, "status": "success", "deep": nested(40)}, "nested deeper than"),
}


@pytest.mark.parametrize("already_stored", [True, False], ids=["stored-before-start", "written-while-running"])
@pytest.mark.parametrize("what", sorted(BAD_TAGS))
def test_a_bad_record_is_quarantined_and_everything_else_flows(db: str, store: SqliteSource, what: str,
                                                               already_stored: bool, caplog) -> None:
    tags, reason = BAD_TAGS[what]
    store.kv_batch_put(["a", "b"], "train", tags=[{"global_steps": 1, "status": "success"}] * 2)
    if already_stored:
        store.kv_put("bad", "train", tag=tags)
    with caplog.at_level(logging.WARNING, logger="poller"), \
            ReplayBuffer(SQLITE, source_kwargs={"path": db}, poll_interval=0.05, max_restarts=0) as rb:
        if not already_stored:
            rb.sync(timeout=30)
            store.kv_put("bad", "train", tag=tags)
        store.kv_put("c", "train", tag={"global_steps": 1, "status": "success"})
        rb.sync(timeout=30)
        assert wait_until(lambda: rb.stats()["quarantined"] == 1)
        stats = rb.stats()
        (partition, key, why), = stats["quarantined_keys"]
        assert (partition, key) == ("train", "bad") and reason in why
        assert stats["source_errors"] == 0 and stats["restarts"] == 0 and stats["poller_alive"]
        assert rb.metrics()["replay.stream.quarantined"] == 1.0
        assert rb.sample("train", global_steps=1, timeout=10).keys == ["a", "b", "c"]
        # The poller's WARNING comes as a LOG message, which may follow the heartbeat that counted the key.
        assert wait_until(lambda: any("quarantined train/bad" in r.getMessage() and reason in r.getMessage()
                                      for r in caplog.records))
        # Its tags become valid: it comes back. Cleared: it leaves.
        store.kv_clear(["bad"], "train")
        store.kv_put("bad", "train", tag={"global_steps": 1, "status": "success"})
        rb.sync(timeout=30)
        assert wait_until(lambda: rb.stats()["quarantined"] == 0)
        assert rb.sample("train", global_steps=1, timeout=10).keys == ["a", "b", "c", "bad"]
        store.kv_put("bad", "train", tag=tags)  # bad again: it leaves the buffer while quarantined
        rb.sync(timeout=30)
        assert "bad" not in rb.snapshot("train")
        assert wait_until(lambda: rb.stats()["quarantined"] == 1)
        store.kv_clear(["bad"], "train")
        rb.sync(timeout=30)
        assert wait_until(lambda: rb.stats()["quarantined"] == 0)
        assert rb.stats()["source_errors"] == 0 and rb.stats()["restarts"] == 0


def test_a_verl_wait_names_the_quarantined_keys_of_its_partition(db: str, store: SqliteSource) -> None:
    # The prompt's own tags cannot go on the wire: its group can never finish in the buffer's view.
    store.kv_put("stuck", "train", tag={"is_prompt": True, "status": "finished", "global_steps": 0,
                                        "note": "x" * (2 * 1024 * 1024)})
    store.kv_put("stuck_0_0", "train", tag={"status": "success", "global_steps": 0})
    sampler = VerlSampler(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=8,
                          max_off_policy_strategy="drop",
                          sampler_kwargs={"source": SQLITE, "source_kwargs": {"path": db}, "poll_interval": 0.05,
                                          "sample_timeout": 2.0})
    try:
        with pytest.raises(TimeoutError, match=r"1 key\(s\) of this partition are quarantined .*'stuck': "
                                               r"a value of \d+ bytes exceeds max_str_len"):
            sampler.sample(global_steps=0, partition_id="train", batch_size=1)
    finally:
        sampler.close()


# -- rows another tool wrote that this store cannot read -------------------------------------------------------

def _write(db: str, sql: str, *params: object) -> None:
    """A second writer, plain sqlite3: what another tool sharing the file does."""
    conn = sqlite3.connect(db)
    try:
        with conn:
            conn.execute(sql, params)
    finally:
        conn.close()


# what (a row of poller.faults.store.UNREADABLE): (the key as the quarantine names it, a part of the reason)
UNREADABLE_ROWS = {
    "tags-not-json": ("bad", "are not JSON"),
    "tags-not-an-object": ("bad", "are list, not an object"),
    "tags-not-utf8": ("bad", "are not UTF-8 text"),
    "tags-nested-too-deep": ("bad", "nest deeper than JSON can be read"),
    "key-not-utf8": ("b'key\\xff' (bytes)", "key is bytes, not str"),
    "blob-key": ("b'blob' (bytes)", "key is bytes, not str"),
}


# How the poller reads the row: in its first snapshot, in a change read, or listed by a source with kv_list()
# alone (a fault wrapper that never fires).
READS = {
    "snapshot": (SQLITE, {}),
    "change-read": (SQLITE, {}),
    "kv_list": ("poller.faults:slow", {"inner": SQLITE, "seconds": 0.0}),
}


@pytest.mark.parametrize("read", sorted(READS))
@pytest.mark.parametrize("what", sorted(UNREADABLE_ROWS))
def test_a_row_the_store_cannot_read_is_quarantined_and_every_partition_flows(db: str, store: SqliteSource,
                                                                              what: str, read: str) -> None:
    # Before: the source raised (ValueError from the JSON, or sqlite3.OperationalError fetching TEXT that is
    # not UTF-8), every poll failed, and after 3 restarts sample("train") raised PollerCrashed (~7.9 s).
    named, reason = UNREADABLE_ROWS[what]
    tags_sql = UNREADABLE[what][1]
    store.kv_batch_put(["a", "b"], "train", tags=[{"global_steps": 1, "status": "success"}] * 2)
    store.kv_put("fine", "other", tag={"v": 1})
    if read == "snapshot":
        write_unreadable(db, "other", what)
    spec, kwargs = READS[read]
    kwargs = {**kwargs, "inner_kwargs": {"path": db}} if kwargs else {"path": db}
    # listing_share=1.0: a kv_list() source is listed at every poll, not held to the default share (poller.duty).
    with ReplayBuffer(spec, source_kwargs=kwargs, poll_interval=0.05, listing_share=1.0) as rb:
        if read != "snapshot":
            rb.sync(timeout=30)
            write_unreadable(db, "other", what)
        store.kv_put("c", "train", tag={"global_steps": 1, "status": "success"})
        rb.sync(timeout=30)
        assert wait_until(lambda: rb.stats()["quarantined"] == 1)
        (partition, key, why), = rb.stats()["quarantined_keys"]
        assert (partition, key) == ("other", named) and reason in why, why
        assert rb.sample("train", global_steps=1, timeout=10).keys == ["a", "b", "c"]
        assert rb.snapshot("other") == {"fine": {"v": 1}}
        if named == "bad":  # fixed by its tool (valid JSON now): it flows
            _write(db, "UPDATE kv SET tags = '{\"v\": 2}' WHERE partition_id = 'other' AND key = 'bad'")
            rb.sync(timeout=30)
            assert wait_until(lambda: rb.stats()["quarantined"] == 0)
            assert rb.snapshot("other") == {"fine": {"v": 1}, "bad": {"v": 2}}
            _write(db, f"UPDATE kv SET tags = {tags_sql} WHERE partition_id = 'other' AND key = 'bad'")
            rb.sync(timeout=30)
            assert wait_until(lambda: rb.stats()["quarantined"] == 1)
            assert rb.snapshot("other") == {"fine": {"v": 1}}  # unreadable again: it leaves the buffer
        delete_unreadable(db, "other", what)
        rb.sync(timeout=30)
        assert wait_until(lambda: rb.stats()["quarantined"] == 0)  # deleted: it leaves the quarantine
        store.kv_put("d", "train", tag={"global_steps": 1, "status": "success"})
        rb.sync(timeout=30)
        assert rb.sample("train", global_steps=1, timeout=10).keys == ["a", "b", "c", "d"]
        stats = rb.stats()
        assert stats["restarts"] == 0 and stats["source_errors"] == 0 and stats["poller_alive"]


# A tag value nested past any limit, as a store client can hand it over in-process (a custom source's kv_list(),
# TransferQueue's unpickled tags): within the receiver's max_depth, and past the interpreter's recursion limit.
DEEP_LIMITS = {"default": None, "max_depth past the recursion limit": {"max_depth": 100_000}}


@pytest.mark.parametrize("limits", sorted(DEEP_LIMITS))
@pytest.mark.parametrize("kind", ["dict", "list"])
def test_a_tag_value_nested_past_any_limit_is_quarantined_whatever_the_source(kind: str, limits: str) -> None:
    # Before: with a max_depth the interpreter cannot recurse to, the screen's walk raised RecursionError: every
    # poll failed, and the poller ended (PollerCrashed) although one record was at fault.
    with ReplayBuffer("tests.helpers.sources:DeepTags", source_kwargs={"kind": kind, "levels": 5000},
                      poll_interval=0.05, listing_share=1.0, limits=DEEP_LIMITS[limits], max_restarts=0) as rb:
        rb.sync(timeout=30)
        rb.sync(timeout=30)  # every listing holds a new key: each one flows past the quarantined key
        assert wait_until(lambda: rb.stats()["quarantined"] == 1)
        (partition, key, why), = rb.stats()["quarantined_keys"]
        assert (partition, key) == ("train", "deep") and "nested deeper than" in why, why
        listed = rb.snapshot("train")
        assert "a" in listed and "deep" not in listed and len([k for k in listed if k.startswith("later")]) == 1
        stats = rb.stats()
        assert stats["source_errors"] == 0 and stats["restarts"] == 0 and stats["poller_alive"]


def test_deleting_a_blob_key_neither_fails_a_poll_nor_restarts_the_poller(db: str, store: SqliteSource) -> None:
    # A TEXT column keeps a BLOB as bytes. Before: each delete of such a key raised TypeError in the poller
    # (a source error and a restart; keys written right after came ~2 s late) and the fourth PollerCrashed.
    store.kv_put("a", "train", tag={"global_steps": 1, "status": "success"})
    with ReplayBuffer(SQLITE, source_kwargs={"path": db}, poll_interval=0.05) as rb:
        rb.sync(timeout=30)
        for round_ in range(4):
            blob = f"blob{round_}".encode()
            _write(db, "INSERT INTO kv (partition_id, key, tags) VALUES ('train', ?, '{}')", blob)
            rb.sync(timeout=30)
            assert wait_until(lambda: rb.stats()["quarantined"] == 1)
            assert rb.stats()["quarantined_keys"] == [("train", f"{blob!r} (bytes)", "key is bytes, not str")]
            _write(db, "DELETE FROM kv WHERE partition_id = 'train' AND key = ?", blob)
            # Put and deleted between two polls: only its delete is read, and it was never quarantined.
            _write(db, "INSERT INTO kv (partition_id, key, tags) VALUES ('train', ?, '{}')", b"brief")
            _write(db, "DELETE FROM kv WHERE key = ?", b"brief")
            store.kv_put(f"after{round_}", "train", tag={"global_steps": 1, "status": "success"})
            rb.sync(timeout=30)
            assert f"after{round_}" in rb.snapshot("train")
            assert wait_until(lambda: rb.stats()["quarantined"] == 0)
        stats = rb.stats()
        assert stats["restarts"] == 0 and stats["source_errors"] == 0 and stats["poller_alive"]
        assert sorted(rb.snapshot("train")) == ["a", "after0", "after1", "after2", "after3"]


def test_a_delete_of_a_name_no_stream_carries_releases_it_or_is_counted(caplog) -> None:
    quarantine = Quarantine()
    quarantine.replace([Refused("p", b"blob", "key is bytes, not str"), Refused("p", "bad", "its tags ...")])
    assert quarantine.names() == [["p", "b'blob' (bytes)", "key is bytes, not str"], ["p", "bad", "its tags ..."]]
    with caplog.at_level(logging.INFO, logger="poller.quarantine"):
        quarantine.update([], {}, {"p": [b"blob", b"never", ["unhashable"]], b"q": ["k"], "r": ["fine"]})
    assert list(quarantine.keys) == [("p", "bad")] and quarantine.ignored_deletes == 3
    assert any("ignored 3 delete(s)" in r.getMessage() and "b'never' (bytes)" in r.getMessage()
               for r in caplog.records)
    quarantine.update([], {}, {"p": ["bad"]})
    assert quarantine.keys == {} and quarantine.ignored_deletes == 3
