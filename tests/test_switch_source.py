"""``ReplayBuffer.switch_source``: the poller follows a replaced store, drops the old store's keys, decides on
no view of the old one (nor on a half-listed new one), and a switch is no crash (no restart budget)."""

from __future__ import annotations

from pathlib import Path

import pytest

from buffer import BufferClosed, ReplayBuffer
from poller.sources.sqlite import SqliteSource
from tests.conftest import alive, wait_until

SQLITE = "poller.sources.sqlite:SqliteSource"
FAULTS = "poller.faults"


def _filled(path: Path, items: dict[str, dict]) -> str:
    with SqliteSource(path) as store:
        for key, tags in items.items():
            store.kv_put(key, "train", tag=tags)
    return str(path)


@pytest.fixture
def old_and_new(tmp_path: Path) -> tuple[str, str]:
    """Two stores: the old one, and the one that replaced it, holding a key of the same name with other tags."""
    old = _filled(tmp_path / "old.db", {"a1": {"global_steps": 1, "status": "success"},
                                        "a2": {"global_steps": 1, "status": "success"},
                                        "same": {"global_steps": 1, "status": "running", "from_old": True}})
    new = _filled(tmp_path / "new.db", {"b1": {"global_steps": 1, "status": "success"},
                                        "same": {"global_steps": 1, "status": "success"}})
    return old, new


def test_the_poller_follows_the_new_store_and_the_old_keys_are_gone_at_once(old_and_new):
    old, new = old_and_new
    # max_restarts=0: a switch that used the restart budget would leave none.
    with ReplayBuffer(SQLITE, source_kwargs={"path": old}, poll_interval=0.05, max_restarts=0) as rb:
        assert wait_until(lambda: set(rb.snapshot("train")) == {"a1", "a2", "same"})
        old_pid = rb.stats()["poller_pid"]
        report = rb.switch_source({"path": new})
        assert report.stage == "graceful" and report.exitcode == 0 and report.drained
        # From the return on, nothing of the old store is shown, even before the new one is listed.
        assert set(rb.snapshot("train")) <= {"b1", "same"}
        batch = rb.sample("train", global_steps=1, timeout=30)
        assert dict(zip(batch.keys, batch.tags)) == {"b1": {"global_steps": 1, "status": "success"},
                                                     "same": {"global_steps": 1, "status": "success"}}
        stats = rb.stats()
        assert stats["restarts"] == 0 and stats["source_switches"] == 1, stats
        assert stats["poller_pid"] != old_pid and not alive(old_pid) and stats["poller_alive"]
        assert rb.metrics()["replay.poller.source_switches"] == 1.0
        # The new store is followed as the old one was.
        with SqliteSource(new) as store:
            store.kv_put("b2", "train", tag={"global_steps": 1, "status": "success"})
        assert wait_until(lambda: "b2" in rb.snapshot("train"))


def test_no_decision_is_made_before_the_new_store_is_listed_whole(tmp_path, old_and_new):
    _, new = old_and_new
    old = _filled(tmp_path / "ready.db", {"a1": {"global_steps": 1, "status": "success"}})
    # The new store's listings take a second longer: a decision on the view between the switch and that
    # listing would hand out the old store's batch, or nothing (the old keys are gone).
    with ReplayBuffer(f"{FAULTS}:slow", source_kwargs={"inner": SQLITE, "inner_kwargs": {"path": old},
                                                       "seconds": 0.0},
                      poll_interval=0.05) as rb:
        assert wait_until(lambda: "a1" in rb.snapshot("train"))
        rb.switch_source({"inner_kwargs": {"path": new}, "seconds": 1.0})
        assert not rb.stats()["view_whole"]
        batch = rb.sample("train", global_steps=1, timeout=30)
        assert sorted(batch.keys) == ["b1", "same"] and not any("from_old" in tags for tags in batch.tags)
        assert rb.stats()["view_whole"]


def test_a_new_store_that_cannot_be_reached_yet_is_retried_without_using_the_restart_budget(old_and_new, tmp_path):
    old, new = old_and_new
    flag = tmp_path / "new-store-down"
    flag.touch()
    with ReplayBuffer(f"{FAULTS}:down", source_kwargs={"inner": SQLITE, "inner_kwargs": {"path": old},
                                                       "when_exists": str(tmp_path / "never")},
                      poll_interval=0.05, max_restarts=0) as rb:
        assert wait_until(lambda: "a1" in rb.snapshot("train"))
        rb.switch_source({"inner_kwargs": {"path": new}, "when_exists": str(flag)})
        assert wait_until(lambda: rb.stats()["start_retries"] >= 2, timeout=30), rb.stats()
        with pytest.raises(TimeoutError, match="not whole"):
            rb.sample("train", global_steps=1, timeout=0.2)
        assert rb.snapshot("train") == {}
        flag.unlink()  # the new store answers
        batch = rb.sample("train", global_steps=1, timeout=30)
        assert sorted(batch.keys) == ["b1", "same"]
        stats = rb.stats()
        assert stats["restarts"] == 0 and stats["source_switches"] == 1 and stats["poller_alive"], stats


def test_switch_source_refuses_bad_arguments_and_a_closed_buffer(db):
    with pytest.raises(ValueError, match="no poller of its own"):
        with ReplayBuffer() as idle:
            idle.switch_source({"path": db})
    rb = ReplayBuffer(SQLITE, source_kwargs={"path": db}, poll_interval=0.05)
    try:
        with pytest.raises(TypeError, match="mapping"):
            rb.switch_source([("path", db)])  # type: ignore[arg-type]
        assert rb.stats()["source_switches"] == 0
    finally:
        rb.close()
    with pytest.raises(BufferClosed):
        rb.switch_source({"path": db})


def test_a_key_removed_from_the_old_store_is_a_new_record_in_the_new_one(tmp_path: Path):
    """The same name and the same tags, in another store: not the record the trainer removed."""
    done = {"global_steps": 1, "status": "success"}
    old = _filled(tmp_path / "old.db", {"k": done})
    new = _filled(tmp_path / "new.db", {"k": done})
    with ReplayBuffer(SQLITE, source_kwargs={"path": old}, poll_interval=0.05) as rb:
        rb.sync(timeout=30)
        rb.remove("train", ["k"])
        rb.switch_source({"path": new})
        assert rb.sample("train", global_steps=1, timeout=30).keys == ["k"]
