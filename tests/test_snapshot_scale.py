"""A real poller over 100k keys: the first listing, a change set and a resync leave the buffer equal to the store.

Snapshots travel packed per key and the buffer keeps the bytes as they
arrived (:meth:`buffer.store.PartitionStore.apply`); whatever
shortcut that takes, what the buffer holds must be what the store lists.
"""

from __future__ import annotations

import pytest

from buffer import ReplayBuffer
from poller.sources.sqlite import SqliteSource
from tests.conftest import wait_until
from tests.helpers.gaps import lose_a_message

pytestmark = pytest.mark.timeout(240)

KEYS = 100_000
PARTITIONS = ("train", "val")


def _fill(store: SqliteSource) -> None:
    for partition in PARTITIONS:
        names = [f"{partition}-{i:06d}" for i in range(KEYS // len(PARTITIONS))]
        for start in range(0, len(names), 10_000):
            chunk = names[start:start + 10_000]
            store.kv_batch_put(chunk, partition, tags=[
                {"global_steps": i % 50, "status": "success", "reward": (i % 97) / 97, "text": f"r{i}"}
                for i in range(start, start + len(chunk))])


def test_the_buffer_equals_the_store_at_100k_keys_after_start_changes_and_a_resync(db: str,
                                                                                store: SqliteSource) -> None:
    _fill(store)
    with ReplayBuffer(source="poller.sources.sqlite:SqliteSource", source_kwargs={"path": db},
                      poll_interval=0.2, start_timeout=120) as rb:
        rb.sync(timeout=120)
        assert rb.snapshot() == store.kv_list()
        # One key in a hundred changes, a few vanish, one partition is new.
        changed = [f"train-{i:06d}" for i in range(0, KEYS // 2, 100)]
        store.kv_batch_put(changed, "train", tags=[{"status": "failure", "extra": [1, {"a": None}]}] * len(changed))
        store.kv_clear([f"val-{i:06d}" for i in range(10)], "val")
        store.kv_put("only", "new", tag={"global_steps": 1})
        rb.sync(timeout=60)
        assert rb.snapshot() == store.kv_list()
        # A resync re-lists everything; the buffer already holds it but must end equal all the same.
        store.kv_batch_put(changed[:50], "train", tags=[{"status": "success"}] * 50)
        snapshots = rb.stats()["snapshots"]
        lose_a_message(rb)
        assert wait_until(lambda: rb.stats()["snapshots"] > snapshots, timeout=120)
        rb.sync(timeout=60)
        assert rb.snapshot() == store.kv_list()
        assert rb.stats()["protocol_errors"] == 0 and rb.stats()["restarts"] == 0
