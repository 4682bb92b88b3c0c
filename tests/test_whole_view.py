"""No decision on a view that was never whole (a slow first listing, a resync half-applied), or is not fresh.

A store larger than the constructor's capped first wait (a million keys take
~10 s to list) used to give partial answers: ``sample(global_steps=g)``
returned an empty or partial batch at once, and a trainer trained on part of
a step and removed it. Here a real poller lists a real SQLite store through
the ``slow`` fault (each listing takes longer than the constructor waits).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from buffer import ReplayBuffer
from buffer.sampling import SamplingAccess
from buffer.steps import StepSampler
from buffer.store import PartitionStore
from buffer.verl import ReplayBuffer as VerlSampler
from poller.sources.sqlite import SqliteSource
from tests.conftest import wait_until
from tests.helpers.deltas import apply

SQLITE = "poller.sources.sqlite:SqliteSource"
# Longer than the constructor's capped wait for the first listing (5 s).
SLOW_LISTING_S = 6.0


def _slow(db: str) -> dict[str, Any]:
    return {"source": "poller.faults:slow",
            "source_kwargs": {"inner": SQLITE, "inner_kwargs": {"path": db}, "seconds": SLOW_LISTING_S}}


def _step(store: SqliteSource, step: int, count: int) -> list[str]:
    keys = [f"s{step}-{i:03d}" for i in range(count)]
    store.kv_batch_put(keys, "train", tags=[{"global_steps": step, "status": "success"}] * count)
    return keys


def test_sample_waits_for_the_first_complete_listing(db: str, store: SqliteSource) -> None:
    keys = _step(store, 3, 40)
    with ReplayBuffer(**_slow(db), poll_interval=60.0) as rb:
        # The constructor gave up waiting (capped): nothing whole to decide on yet.
        with pytest.raises(TimeoutError, match="not whole: the first complete listing of poller"):
            rb.sample("train", global_steps=3, timeout=0.2)  # before: an empty batch at once
        stats = rb.stats()
        assert not stats["view_whole"] and "first complete listing" in (stats["view_gap"] or "")
        with pytest.raises(TimeoutError, match="not whole"):
            rb.sample("train", batch_size=1, timeout=0)
        batch = rb.sample("train", global_steps=3, timeout=60)
        assert batch.keys == keys
        assert rb.sample("train", batch_size=40, timeout=0).keys == keys
        assert rb.stats()["view_whole"] and rb.stats()["view_gap"] is None
        assert rb.metrics()["replay.view.whole"] == 1.0


def test_verl_decisions_wait_for_the_first_complete_listing(db: str, store: SqliteSource) -> None:
    for i in range(4):
        uid = f"u{i}"
        store.kv_put(uid, "train", tag={"is_prompt": True, "status": "pending", "global_steps": 0})
        store.kv_put(f"{uid}_0_0", "train", tag={"status": "success", "global_steps": 0})
        store.kv_put(uid, "train", tag={"status": "finished"})
    sampler = VerlSampler(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=8,
                          max_off_policy_strategy="drop",
                          sampler_kwargs={**_slow(db), "poll_interval": 60.0, "sample_timeout": 60})
    try:
        # Before: 0 (the constructor's wait ran out and the count came from an empty view).
        assert sampler.get_sampleable_count(0, "train") == 4
    finally:
        sampler.close()


def test_a_resync_half_applied_is_not_decided_on() -> None:
    """Store level: the own poller's full listing, begun and not ended, holds every decision."""
    store = PartitionStore()
    steps = StepSampler(SamplingAccess(store))
    store.require("own")
    apply(store, "own", {"train": {"a": {"global_steps": 1, "status": "success"}}}, full=True, reset=True)
    apply(store, "own", full=True, end=True)
    assert steps.sample("train", global_steps=1, timeout=0).keys == ["a"]
    # A resync: the new listing arrives in parts; until its end the view mixes old and new.
    store.mark_broken("own")
    with pytest.raises(TimeoutError, match="lost messages: its next full listing is awaited"):
        steps.sample("train", global_steps=1, timeout=0)
    apply(store, "own", {"train": {"b": {"global_steps": 1, "status": "success"}}}, poll=2, full=True, reset=True)
    with pytest.raises(TimeoutError, match=r"a full listing \(resync\) of poller own is being applied"):
        steps.sample("train", global_steps=1, timeout=0)
    apply(store, "own", poll=2, full=True, end=True)  # "a" was not listed again: it vanished with the snapshot
    assert steps.sample("train", global_steps=1, timeout=0).keys == ["b"]


def test_a_standalone_pollers_snapshot_holds_only_its_partitions() -> None:
    store = PartitionStore()
    steps = StepSampler(SamplingAccess(store))
    apply(store, "other", {"val": {"v": {"global_steps": 1, "status": "success"}}})
    apply(store, "standalone", {"train": {"a": {"global_steps": 1, "status": "success"}}}, full=True, reset=True)
    with pytest.raises(TimeoutError, match="poller standalone, which lists this partition"):
        steps.sample("train", global_steps=1, timeout=0)
    assert steps.sample("val", global_steps=1, timeout=0).keys == ["v"]
    store.release("standalone")  # it went silent: decisions go on without it
    assert steps.sample("train", global_steps=1, timeout=0).keys == ["a"]


# -- fresh views ---------------------------------------------------------------------------


def _three_done(store: SqliteSource) -> None:
    store.kv_batch_put(["k1", "k2", "k3"], "train", tags=[{"global_steps": 1, "status": "success"}] * 3)


def test_no_decision_while_the_store_does_not_answer(db: str, store: SqliteSource, tmp_path) -> None:
    _three_done(store)
    flag = tmp_path / "hung"
    # A client with a deadline whose server hangs while the flag exists (poller.faults.stall).
    with ReplayBuffer("poller.faults:stall", source_kwargs={"inner": SQLITE, "inner_kwargs": {"path": db},
                                                           "when_exists": str(flag), "seconds": 0.3},
                      poll_interval=0.05) as rb:
        assert len(rb.sample("train", batch_size=3, timeout=10).keys) == 3
        flag.touch()  # the store stops answering: every call gives up at its deadline
        assert wait_until(lambda: rb.stats()["source_stalls"] >= 2, timeout=20)
        # Before: three keys at once from the last view, with view_whole=True.
        with pytest.raises(TimeoutError, match=r"is not fresh: the store of poller \S+ has not answered for"):
            rb.sample("train", batch_size=3, timeout=1)
        stats = rb.stats()
        assert stats["view_whole"] and not stats["view_fresh"] and "stalled" in (stats["view_stale"] or "")
        assert rb.metrics()["replay.view.fresh"] == 0.0
        store.kv_put("k4", "train", tag={"global_steps": 1, "status": "success"})
        flag.unlink()  # it answers again: the first complete poll makes the view fresh
        assert rb.sample("train", batch_size=4, timeout=30).keys == ["k1", "k2", "k3", "k4"]
        assert rb.stats()["view_fresh"] and rb.stats()["view_stale"] is None


def test_no_decision_on_a_view_older_than_max_view_age(db: str, store: SqliteSource) -> None:
    _three_done(store)
    with ReplayBuffer(SQLITE, source_kwargs={"path": db}, poll_interval=4.0, max_view_age=1.0) as rb:
        rb.sync(timeout=30)
        assert len(rb.sample("train", batch_size=3, timeout=0).keys) == 3
        time.sleep(1.5)
        with pytest.raises(TimeoutError, match=r"is not fresh: .* applied \S+s ago, more than max_view_age=1s"):
            rb.sample("train", batch_size=3, timeout=0)
        # The next poll of the schedule makes it fresh, and wakes the waiter.
        assert len(rb.sample("train", batch_size=3, timeout=30).keys) == 3


def test_no_decision_while_the_poller_is_stopped(db: str, store: SqliteSource) -> None:
    _three_done(store)
    with ReplayBuffer(SQLITE, source_kwargs={"path": db}, poll_interval=0.05, stale_after=1.0) as rb:
        rb.sync(timeout=30)
        pid = rb.stats()["poller_pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: not rb.stats()["view_fresh"], timeout=15)
            with pytest.raises(TimeoutError, match="its poller has sent nothing for more than stale_after=1s"):
                rb.sample("train", batch_size=3, timeout=0.5)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert len(rb.sample("train", batch_size=3, timeout=30).keys) == 3


def test_by_default_a_view_may_age_60s_or_three_poll_intervals() -> None:
    from buffer.replay import default_max_view_age

    assert default_max_view_age(1.0) == 60.0
    # A poller asked to list every 2 minutes is not waited for between two of its polls.
    assert default_max_view_age(120.0) == 360.0
