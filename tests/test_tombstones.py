"""Removed-key tombstones: what ``remove()`` hides, and for how long.

A removal hides the record *as it was when removed*: the same tags listed
again stay hidden, a new version of the key (updated in place, or cleared and
put again between two listings) is a new record and is shown. Checked on a
real SQLite store, read through its change feed and listed in full, at the
fastest and the slowest schedule.

Then under clock skew between the trainer and a poller's host: a scripted
peer plays a poller on another host whose clock differs from the trainer's by
``skew`` seconds: it stamps each DELTA's ``t`` (the poll's start on its own
clock) as that host would. Polls are numbered as a real poller numbers them.
The buffer is real, over a real socket.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from buffer import ReplayBuffer
from poller.faults.peer import RoguePeer, packed_delta
from poller.faults.store import replace
from poller.wire.protocol import Kind
from tests.conftest import wait_until

SOURCES = {"change-feed": "poller.sources.sqlite:SqliteSource", "listed": "tests.helpers.sources:ListedSqlite"}
DONE = {"global_steps": 1, "status": "success"}


@pytest.mark.parametrize("poll_interval", [0.05, 1.0], ids=["fast", "slow"])
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_removed_keys_new_version_is_shown_and_the_removed_one_never(db, store, source, poll_interval):
    for key in ("in-place", "put-again", "same-again", "kept"):
        store.kv_put(key, "train", tag=DONE)
    with ReplayBuffer(source=SOURCES[source], source_kwargs={"path": db}, poll_interval=poll_interval) as rb:
        rb.sync(timeout=30)
        assert sorted(rb.snapshot("train")) == ["in-place", "kept", "put-again", "same-again"]
        rb.remove("train", ["in-place", "put-again", "same-again", "kept"])
        store.kv_put("in-place", "train", tag={"status": "finished"})      # updated in place
        replace(db, "train", "put-again", {"global_steps": 2, "status": "success"})  # a new record, same name
        replace(db, "train", "same-again", DONE)  # the same tags again
        # A poll under way at the removal may list the new versions: shown once a later poll lists them still.
        # Before, neither new version was ever shown (a tombstone ended only when a listing omitted the key).
        rb.sync(timeout=30)
        rb.sync(timeout=30)
        assert rb.snapshot("train") == {"in-place": {"global_steps": 1, "status": "finished"},
                                        "put-again": {"global_steps": 2, "status": "success"}}
        assert rb.sample("train", global_steps=2, timeout=5).keys == ["put-again"]
        # The removed records stay hidden while the store lists them unchanged, at any rate.
        time.sleep(2.5 * poll_interval)
        assert "same-again" not in rb.snapshot("train") and "kept" not in rb.snapshot("train")


@pytest.fixture
def rb():
    buffer = ReplayBuffer()
    yield buffer
    buffer.close()


@pytest.fixture
def peer(rb):
    p = RoguePeer(rb.endpoint, name="skewed-host", epoch=5)
    p.ready()
    yield p
    p.close()


def _poll(rb: ReplayBuffer, peer: RoguePeer, number: int, started: float, upserts: dict[str, Any]) -> None:
    """Send poll ``number`` (begun at ``started`` on the peer's clock) whole; wait until it is applied."""
    marker = f"poll-{number}"
    peer.send(Kind.DELTA, packed_delta({**upserts, "marks": {marker: {}}}, poll=number)._replace(t=started))
    assert wait_until(lambda: marker in rb.snapshot("marks"))


@pytest.mark.parametrize("skew", [0.0, 60.0], ids=["same-clock", "trainer-60s-behind"])
def test_a_removed_key_still_listed_does_not_come_back(rb, peer, skew):
    _poll(rb, peer, 1, time.time() + skew, {})
    rb.add("train", {"k": {"global_steps": 1, "status": "success"}})  # the trainer's own tags, not yet listed
    under_way = time.time() + skew  # poll 2 began before the removal
    rb.remove("train", ["k"])
    _poll(rb, peer, 2, under_way, {})  # its listing predates the key
    # Poll 3 began after the removal and the store still lists the key (not
    # cleared there): it stays removed.
    _poll(rb, peer, 3, time.time() + skew, {"train": {"k": {"global_steps": 1, "status": "success"}}})
    _poll(rb, peer, 4, time.time() + skew, {})
    assert "k" not in rb.snapshot("train")
    assert rb.sample("train", global_steps=1, timeout=0).keys == []


@pytest.mark.parametrize("skew", [0.0, -2.0], ids=["same-clock", "trainer-2s-ahead"])
def test_a_new_key_of_a_removed_name_is_not_hidden(rb, peer, skew):
    _poll(rb, peer, 1, time.time() + skew, {})
    rb.add("train", {"k": {"global_steps": 1, "status": "success"}})
    under_way = time.time() + skew
    rb.remove("train", ["k"])
    _poll(rb, peer, 2, under_way, {})
    time.sleep(0.01)  # a real poller's next poll starts later than the removal on one clock
    _poll(rb, peer, 3, time.time() + skew, {})  # began after the removal, does not list it: the removal is settled
    # Then a new key of that name is written to the store.
    _poll(rb, peer, 4, time.time() + skew, {"train": {"k": {"global_steps": 2, "status": "success"}}})
    _poll(rb, peer, 5, time.time() + skew, {})
    assert rb.snapshot("train") == {"k": {"global_steps": 2, "status": "success"}}
    assert rb.sample("train", global_steps=2, timeout=5).keys == ["k"]
