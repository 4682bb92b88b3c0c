"""ReplayBuffer semantics over a real poller process and a real SQLite store."""

from __future__ import annotations

import threading
import time

import pytest

from buffer import BatchMeta, BufferClosed, ReplayBuffer
from tests.conftest import wait_until

SQLITE = "poller.sources.sqlite:SqliteSource"


@pytest.fixture
def rb(db):
    buffer = ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.02)
    yield buffer
    buffer.close()


def test_rows_in_the_store_before_start_are_visible_at_once(store, db):
    store.kv_batch_put(["a", "b"], "train", tags=[{"status": "success"}, {"status": "running"}])
    with ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.5) as rb:
        assert rb.snapshot("train") == {"a": {"status": "success"}, "b": {"status": "running"}}


def test_worker_tags_merge_with_trainer_markers(rb, store):
    rb.add("train", {"u1": {"global_steps": 3, "status": "running"}})
    store.kv_put("u1", "train", tag={"status": "success"})  # a worker's tag lacks global_steps
    batch = rb.sample("train", global_steps=3, timeout=10)
    assert batch == BatchMeta("train", ["u1"], [{"global_steps": 3, "status": "success"}])


def test_add_merges_and_never_replaces(rb):
    rb.add("p", {"k": {"a": 1, "b": 2}})
    rb.add("p", {"k": {"b": 3, "c": 4}})
    assert rb.snapshot("p") == {"k": {"a": 1, "b": 3, "c": 4}}


def test_store_changes_stream_in_and_cleared_keys_vanish(rb, store):
    store.kv_put("x", "train", tag={"status": "running"})
    assert wait_until(lambda: "x" in rb.snapshot("train"))
    store.kv_put("x", "train", tag={"status": "success", "score": 1})
    assert wait_until(lambda: rb.snapshot("train").get("x") == {"status": "success", "score": 1})
    store.kv_clear(["x"], "train")
    assert wait_until(lambda: rb.snapshot("train") == {})


def test_removed_key_stays_removed_while_the_store_lists_it_unchanged(rb, store):
    store.kv_put("r", "train", tag={"status": "success"})
    assert wait_until(lambda: "r" in rb.snapshot("train"))
    rb.remove("train", ["r"])
    polls = rb.stats()["messages"]
    assert wait_until(lambda: rb.stats()["messages"] >= polls + 10)
    assert "r" not in rb.snapshot("train")  # the record removed, still listed
    store.kv_put("r", "train", tag={"extra": 1})  # a new version of it: a new record, shown
    assert wait_until(lambda: rb.snapshot("train").get("r") == {"status": "success", "extra": 1})
    rb.remove("train", ["r"])
    store.kv_clear(["r"], "train")  # the store stops listing it: the name is free
    assert wait_until(lambda: rb.stats()["messages"] >= polls + 30)
    store.kv_put("r", "train", tag={"status": "success"})  # the first tags again, in a new record
    assert wait_until(lambda: rb.snapshot("train").get("r") == {"status": "success"})


def test_removed_local_key_can_come_back_later(rb):
    rb.add("p", {"k": {"status": "success"}})
    rb.remove("p", ["k"])
    assert rb.snapshot("p") == {}
    rb.add("p", {"k": {"status": "running"}})  # a local add is never blocked
    assert rb.snapshot("p") == {"k": {"status": "running"}}


def test_sample_by_step_skips_other_statuses_and_keeps_arrival_order(rb):
    rb.add("t", {"k1": {"global_steps": 1, "status": "success"},
                 "k2": {"global_steps": 1, "status": "finished"},
                 "k3": {"global_steps": 1, "status": "failure"},
                 "k4": {"global_steps": 2, "status": "success"},
                 "k0": {"global_steps": 1, "status": "success"}})
    batch = rb.sample("t", global_steps=1, timeout=1)
    assert batch.keys == ["k1", "k0"]
    assert [t["status"] for t in batch.tags] == ["success", "success"]
    assert rb.snapshot("t").keys() == {"k0", "k1", "k2", "k3", "k4"}  # sample removes nothing


def test_sample_by_size_returns_the_first_arrivals(rb):
    rb.add("t", {f"k{i}": {"status": "success"} for i in range(5)})
    assert rb.sample("t", batch_size=3, timeout=1).keys == ["k0", "k1", "k2"]


def test_sample_wakes_as_soon_as_the_last_key_lands(rb, store):
    rb.add("t", {"a": {"global_steps": 7, "status": "running"}})
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(rb.sample("t", global_steps=7, timeout=20)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not result
    store.kv_put("a", "t", tag={"status": "success"})
    waiter.join(10)
    assert not waiter.is_alive()
    assert result[0].keys == ["a"]


def test_sample_timeout_says_what_it_waits_for(rb):
    rb.add("t", {"stuck1": {"global_steps": 5, "status": "running"}})
    with pytest.raises(TimeoutError, match=r"1 key\(s\) of step 5 still 'running' \(stuck1\)"):
        rb.sample("t", global_steps=5, timeout=0.1)
    with pytest.raises(TimeoutError, match=r"only 0 of 2 'success'"):
        rb.sample("t", batch_size=2, timeout=0.05)


def test_sample_needs_exactly_one_mode(rb):
    with pytest.raises(ValueError):
        rb.sample("t")
    with pytest.raises(ValueError):
        rb.sample("t", global_steps=1, batch_size=1)


def test_close_wakes_a_waiting_sample_with_buffer_closed(db):
    rb = ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.05)
    rb.add("t", {"a": {"global_steps": 1, "status": "running"}})
    errors: list = []

    def wait() -> None:
        try:
            rb.sample("t", global_steps=1, timeout=30)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assert
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    rb.close()
    waiter.join(5)
    assert not waiter.is_alive()
    assert isinstance(errors[0], BufferClosed)
    for call in (lambda: rb.add("t", {}), lambda: rb.remove("t", []), lambda: rb.snapshot(), rb.stats,
                 lambda: rb.sample("t", batch_size=1)):
        with pytest.raises(BufferClosed):
            call()


def test_stats_report_the_stream(rb, store):
    store.kv_put("s", "train", tag={"status": "success"})
    assert wait_until(lambda: rb.stats()["keys"] == 1)
    stats = rb.stats()
    assert stats["poller_alive"] is True and stats["poller_pid"] > 0
    assert stats["restarts"] == 0 and stats["protocol_errors"] == 0 and stats["source_errors"] == 0
    assert stats["messages"] > 0 and stats["items_received"] >= 1 and stats["bytes_received"] > 0
    assert 0 <= stats["last_message_age_s"] < 5
    assert isinstance(stats["epoch"], int)
    assert rb.partitions == rb.snapshot() == {"train": {"s": {"status": "success"}}}


def test_a_buffer_without_source_takes_local_data_only():
    with ReplayBuffer() as rb:
        rb.add("t", {"k": {"status": "success"}})
        assert rb.sample("t", batch_size=1, timeout=1).keys == ["k"]
        assert rb.stats()["poller_pid"] is None
    assert rb.close().stage == "no-poller"


def test_tcp_bind_takes_a_free_port():
    with ReplayBuffer(bind="tcp://127.0.0.1:0") as rb:
        assert rb.endpoint.startswith("tcp://127.0.0.1:") and not rb.endpoint.endswith(":0")
