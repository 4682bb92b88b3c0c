"""buffer.verl re-runs a waiting decision only when its partition's groups changed.

While ``sample()`` waits, the poller lists every ``poll_interval`` and
every applied listing wakes the wait; the sampler's ``decisions`` counter
counts the rule evaluations. Real poller process, real SQLite store.
"""

from __future__ import annotations

import random
import time
from typing import Any

from poller.sources.sqlite import SqliteSource
from tests.conftest import wait_until
from tests.test_verl import Consumer, produce, uids_of
from tests.test_verl import make as make  # noqa: F401 (a fixture, used by name)


def _settled(rb: Any, polls: int) -> int:
    """Decisions once ``polls`` more listings were applied during the wait."""
    start = rb.stats()["wait_polls"]
    assert wait_until(lambda: rb.stats()["wait_polls"] >= start + polls, timeout=20)
    return int(rb.stats()["decisions"])


def test_polls_that_change_nothing_in_the_partition_rerun_no_rule(make, store: SqliteSource) -> None:
    produce(store, "train", "finished")
    late = produce(store, "train", "running")
    rb = make("colocate_async", poll_interval=0.02)
    consumer = Consumer(lambda: rb.sample(global_steps=0, partition_id="train", batch_size=2))
    consumer.start()
    before = _settled(rb, 3)  # waiting: the first look and whatever was in flight are decided
    assert before >= 1 and consumer.is_alive()
    # Empty listings, another partition's groups, a trajectory's tags, a prompt's other tags.
    produce(store, "val", "running")
    store.kv_put(f"{late}_0_0", "train", tag={"tokens": 12})
    store.kv_put(late, "train", tag={"note": "halfway"})
    assert _settled(rb, 10) == before
    assert consumer.is_alive()
    store.kv_put(late, "train", tag={"status": "finished"})  # what it waits for
    batch, _ = consumer.outcome()
    assert late in uids_of(batch.keys) and len(batch.keys) == 2
    assert rb.stats()["decisions"] == before + 1  # one change, one evaluation, the answer


def test_a_relevant_change_that_does_not_complete_the_wait_is_decided_once(make, store: SqliteSource) -> None:
    produce(store, "train", "finished")
    rb = make(poll_interval=0.02)
    consumer = Consumer(lambda: rb.sample(global_steps=0, partition_id="train", batch_size=3))
    consumer.start()
    before = _settled(rb, 3)
    second = produce(store, "train", "finished")  # a group more: the rule runs again, still short
    assert wait_until(lambda: rb.stats()["decisions"] > before, timeout=20)
    after = _settled(rb, 10)
    assert consumer.is_alive() and after > before
    assert after - before <= 4  # produce() writes four keys; at most one evaluation per change, none per poll
    third = produce(store, "train", "finished")
    batch, _ = consumer.outcome()
    assert {second, third} <= uids_of(batch.keys) and len(batch.keys) == 3


def test_a_change_landing_at_any_moment_of_the_wait_is_never_missed(make, store: SqliteSource) -> None:
    # The version is read under the store's lock and the wait releases that lock atomically, so a change
    # between the check and the wait still wakes it: changes at random moments, each sample must answer.
    rng = random.Random(3)
    rb = make("colocate_async", poll_interval=0.01)
    for _ in range(15):
        late = produce(store, "train", "running")
        consumer = Consumer(lambda: rb.sample(global_steps=0, partition_id="train", batch_size=1))
        consumer.start()
        time.sleep(rng.uniform(0, 0.03))
        store.kv_put(late, "train", tag={"status": "finished"})
        batch, _ = consumer.outcome(timeout=20)
        assert uids_of(batch.keys) == {late}
