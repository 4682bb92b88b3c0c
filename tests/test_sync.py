"""``ReplayBuffer.sync()``: read-your-writes over a real poller process and a real SQLite store.

Every buffer here polls once a minute, so anything seen within a test was
brought by the poll ``sync()`` asked for, not by the schedule.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from buffer import BufferClosed, ReplayBuffer
from poller import PollerCrashed
from tests.conftest import wait_until

SQLITE = "poller.sources.sqlite:SqliteSource"
SLOW_SCHEDULE = 60.0


def _faulty(fault: str, db: str, **kwargs: object) -> dict[str, object]:
    return {"source": f"poller.faults:{fault}",
            "source_kwargs": {"inner": SQLITE, "inner_kwargs": {"path": db}, **kwargs}}


@pytest.fixture
def rb(db, store):
    store.kv_list()  # the file and its schema exist before the poller opens it
    buffer = ReplayBuffer(SQLITE, source_kwargs={"path": db}, poll_interval=SLOW_SCHEDULE)
    yield buffer
    buffer.close()


def test_a_write_is_visible_right_after_sync(rb, store):
    store.kv_put("k1", "train", tag={"global_steps": 1, "status": "success"})
    rb.sync(timeout=30)
    assert rb.snapshot("train") == {"k1": {"global_steps": 1, "status": "success"}}
    assert rb.sample("train", global_steps=1, timeout=0).keys == ["k1"]
    store.kv_clear(["k1"], "train")
    store.kv_put("k2", "train", tag={"status": "running"})
    rb.sync(timeout=30)
    assert rb.snapshot("train") == {"k2": {"status": "running"}}
    assert rb.stats()["polls"] == 3  # the first listing, then one per sync


def test_without_a_source_sync_returns_at_once():
    with ReplayBuffer() as rb:
        rb.add("p", {"k": {}})
        rb.sync()
        rb.sync(timeout=0)
        with pytest.raises(ValueError, match="timeout"):
            rb.sync(timeout=-1)
    with pytest.raises(BufferClosed):
        rb.sync()


def test_bad_timeouts_are_refused(rb):
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout"):
            rb.sync(timeout=bad)


def test_concurrent_callers_each_see_their_own_write(rb, store):
    errors: list[BaseException] = []
    seen: dict[int, bool] = {}

    def writer(i: int) -> None:
        try:
            store_i = type(store)(store.path)
            try:
                store_i.kv_put(f"w{i}", "train", tag={"i": i})
            finally:
                store_i.close()
            rb.sync(timeout=60)
            seen[i] = f"w{i}" in rb.snapshot("train")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors
    assert seen == {i: True for i in range(8)}
    # One listing may answer several callers; never more polls than calls.
    assert 2 <= rb.stats()["polls"] <= 1 + 8


def test_a_stalled_source_times_out_with_a_clear_message(db, store, tmp_path: Path):
    store.kv_list()
    trigger = tmp_path / "hang-now"
    with ReplayBuffer(**_faulty("hang", db, when_exists=str(trigger)), poll_interval=SLOW_SCHEDULE) as rb:
        trigger.touch()
        store.kv_put("k", "train", tag={})
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"sync\(\) timed out .* no complete listing of poller"):
            rb.sync(timeout=1.0)
        assert time.monotonic() - started >= 1.0
        assert "k" not in rb.snapshot("train")
        report = rb.close(timeout=5)
    assert report.stage == "graceful"


def test_sync_survives_a_poller_restart_during_the_wait(db, store, tmp_path: Path):
    store.kv_list()
    trigger, marker = tmp_path / "crash-now", tmp_path / "crashed"
    # The poll that sync() asks for crashes the poller (once): the restarted
    # one never received the request and must be asked again.
    with ReplayBuffer(**_faulty("crash", db, when_exists=str(trigger), marker=str(marker), once=True),
                      poll_interval=SLOW_SCHEDULE) as rb:
        store.kv_put("k", "train", tag={"status": "success"})
        trigger.touch()
        rb.sync(timeout=60)
        assert marker.exists()
        assert rb.stats()["restarts"] == 1
        assert rb.snapshot("train") == {"k": {"status": "success"}}


def test_a_poller_dead_for_good_raises_poller_crashed(db, store, tmp_path: Path):
    store.kv_list()
    trigger = tmp_path / "crash-now"
    with ReplayBuffer(**_faulty("crash", db, when_exists=str(trigger)), poll_interval=SLOW_SCHEDULE,
                      max_restarts=0) as rb:
        trigger.touch()
        with pytest.raises(PollerCrashed):
            rb.sync(timeout=60)


def test_closing_wakes_a_waiting_sync(db, store, tmp_path: Path):
    store.kv_list()
    trigger = tmp_path / "hang-now"
    rb = ReplayBuffer(**_faulty("hang", db, when_exists=str(trigger)), poll_interval=SLOW_SCHEDULE)
    trigger.touch()
    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            rb.sync(timeout=60)
        except BaseException as exc:  # checked below
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    rb.close(timeout=5)
    thread.join(10)
    assert wait_until(lambda: bool(outcome))
    assert isinstance(outcome[0], BufferClosed)


def test_sync_waits_for_standalone_pollers_too(db, store):
    """A key cleared in the store must be gone after sync(), whichever poller still listed it.

    Before, only the buffer's own poller was asked: a standalone poller of the
    same store kept the key in the view until its own next poll (10/10 rounds).
    """
    from poller import PollerProcess

    store.kv_put("k", "train", tag={"status": "success"})
    with ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.05) as rb:
        standalone = PollerProcess(SQLITE, source_kwargs={"path": db},
                                   endpoint=rb.endpoint, name="standalone", poll_interval=30.0)
        standalone.start(30)
        try:
            assert wait_until(lambda: rb.stats()["peers"] == 2, timeout=30)
            rb.sync(timeout=30)  # both pollers' first listings applied
            for round_ in range(3):
                store.kv_clear(["k"], "train")
                rb.sync(timeout=30)
                assert "k" not in rb.snapshot("train"), round_
                store.kv_put("k", "train", tag={"status": "success", "round": round_})
                rb.sync(timeout=30)
                assert rb.snapshot("train")["k"] == {"status": "success", "round": round_}
        finally:
            standalone.close(5)


def test_a_stopped_then_killed_standalone_poller_never_vouches_for_a_fresh_view(db, store):
    """A standalone poller of the same store is SIGSTOPped, then SIGKILLed, and a key only it still lists is cleared.

    Before, sync() returned after stale_after with the cleared key shown, and 15 s after the kill the view held it
    while stats() said view_fresh=True and sample() handed it out. Now the view is not fresh while that poller
    alone lists the key, sync() and sample() wait, and once it has been silent for max_view_age it is withdrawn:
    the key only it listed is dropped.
    """
    import os
    import signal

    from poller import PollerProcess

    keys = [f"k{i}" for i in range(9)]
    store.kv_batch_put(keys, "train", tags=[{"status": "success"} for _ in keys])
    with ReplayBuffer(source=SQLITE, source_kwargs={"path": db}, poll_interval=0.05, stale_after=1.0,
                      max_view_age=4.0) as rb:
        standalone = PollerProcess(SQLITE, source_kwargs={"path": db}, endpoint=rb.endpoint, name="standalone",
                                   poll_interval=30.0)
        standalone.start(30)
        try:
            assert wait_until(lambda: rb.stats()["peers"] == 2, timeout=30)
            rb.sync(timeout=30)
            assert sorted(rb.snapshot("train")) == keys
            assert standalone.pid is not None
            os.kill(standalone.pid, signal.SIGSTOP)
            store.kv_clear(["k8"], "train")
            assert wait_until(lambda: not rb.stats()["view_fresh"], timeout=10)
            assert "standalone" in (rb.stats()["view_stale"] or "")
            with pytest.raises(TimeoutError, match="standalone"):
                rb.sync(timeout=0.5)
            with pytest.raises(TimeoutError, match="not fresh"):
                rb.sample("train", batch_size=9, timeout=0.5)
            os.kill(standalone.pid, signal.SIGKILL)
            # Silent past max_view_age: withdrawn, and what only it listed dropped.
            assert wait_until(lambda: "k8" not in rb.snapshot("train") and rb.stats()["view_fresh"], timeout=20)
            rb.sync(timeout=10)
            assert sorted(rb.snapshot("train")) == keys[:8]
            assert sorted(rb.sample("train", batch_size=8, timeout=5).keys) == keys[:8]
        finally:
            standalone.close(5)


def test_removals_leave_nothing_behind_when_no_poller_streams():
    """A buffer no poller streams to (source=None, or every standalone poller gone) kept a tombstone per removed
    key: 200,000 add + remove grew the trainer by ~84 MB. Nothing can list a removed key back: nothing is kept."""
    with ReplayBuffer() as rb:
        for start in range(0, 200_000, 20_000):
            batch = {f"k{i}": {"status": "success"} for i in range(start, start + 20_000)}
            rb.add("train", batch)
            rb.remove("train", list(batch))
        ledger = rb._core.store.ledger
        assert ledger._tombs == {} and ledger._waiting_on == {}
        assert rb.snapshot() == {}
