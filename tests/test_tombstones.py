"""Removed-key tombstones: what ``remove()`` hides, and for how long.

A removal hides the record *as it was when removed*: the same tags listed
again stay hidden, a new version of the key (updated in place, or cleared and
put again between two listings) is a new record and is shown. Checked on a
real SQLite store, read through its change feed and listed in full, at the
fastest and the slowest schedule.

Then under clock skew between the trainer and a poller's host: a scripted
peer plays a poller on another host whose clock differs from the trainer's by
``skew`` seconds: it stamps each DELTA's ``t`` (the poll's start on its own
clock) as that host would. Polls are numbered as a real poller numbers them, and
any number of them may be on their way when the trainer removes a key: only the
removal's mark (a sync token) tells a poll that began after it. The buffer is
real, over a real socket.
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
        # sync() began after the removal: the listing that answers it shows the new versions (it once took a
        # second sync(): the first listing after a removal was taken as maybe under way at it).
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


def _poll(rb: ReplayBuffer, peer: RoguePeer, number: int, started: float, upserts: dict[str, Any],
          token: int) -> None:
    """Send poll ``number`` (begun at ``started`` on the peer's clock, answering sync token ``token``) whole; wait
    until it is applied."""
    marker = f"poll-{number}"
    peer.send(Kind.DELTA, packed_delta({**upserts, "marks": {marker: {}}}, poll=number,
                                       sync=token)._replace(t=started))
    assert wait_until(lambda: marker in rb.snapshot("marks"))


def _mark(peer: RoguePeer) -> int:
    """The token of the removal's mark the buffer sends (a SYNC asking for no poll)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        message = peer.recv(max(0.0, deadline - time.monotonic()))
        if message is not None and message.kind is Kind.SYNC and message.body.mark:
            return int(message.body.token)
    raise AssertionError("no mark for the removal")


@pytest.mark.parametrize("skew", [0.0, 60.0], ids=["same-clock", "trainer-60s-behind"])
def test_a_removed_key_still_listed_does_not_come_back(rb, peer, skew):
    _poll(rb, peer, 1, time.time() + skew, {}, peer.token)
    rb.add("train", {"k": {"global_steps": 1, "status": "success"}})  # the trainer's own tags, not yet listed
    under_way = time.time() + skew  # polls 2 and 3 began before the removal
    rb.remove("train", ["k"])
    mark = _mark(peer)
    _poll(rb, peer, 2, under_way, {}, peer.token)  # its listing predates the key
    _poll(rb, peer, 3, under_way, {"train": {"k": {"global_steps": 1, "status": "success"}}}, peer.token)
    assert "k" not in rb.snapshot("train")
    # Poll 4 began after the removal (it answers the mark) and the store still lists the key (not cleared
    # there): it stays removed.
    _poll(rb, peer, 4, time.time() + skew, {"train": {"k": {"global_steps": 1, "status": "success"}}}, mark)
    _poll(rb, peer, 5, time.time() + skew, {}, mark)
    assert "k" not in rb.snapshot("train")
    assert rb.sample("train", global_steps=1, timeout=0).keys == []


@pytest.mark.parametrize("skew", [0.0, -2.0], ids=["same-clock", "trainer-2s-ahead"])
def test_a_new_key_of_a_removed_name_is_not_hidden(rb, peer, skew):
    _poll(rb, peer, 1, time.time() + skew, {}, peer.token)
    rb.add("train", {"k": {"global_steps": 1, "status": "success"}})
    under_way = time.time() + skew
    rb.remove("train", ["k"])
    mark = _mark(peer)
    # Polls on their way, begun before the removal, list a new version: it may predate the removal (in doubt).
    _poll(rb, peer, 2, under_way, {}, peer.token)
    _poll(rb, peer, 3, under_way, {"train": {"k": {"global_steps": 2, "status": "success"}}}, peer.token)
    assert "k" not in rb.snapshot("train")
    # The first poll that began after the removal lists it still: a new record of that name.
    _poll(rb, peer, 4, time.time() + skew, {"train": {"k": {"global_steps": 2, "status": "success"}}}, mark)
    assert rb.snapshot("train") == {"k": {"global_steps": 2, "status": "success"}}
    assert rb.sample("train", global_steps=2, timeout=5).keys == ["k"]


@pytest.mark.parametrize("poll_interval", [0.05, 1.0], ids=["fast", "slow"])
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_one_key_name_put_synced_sampled_and_removed_each_step_is_never_missed(db, store, source, poll_interval):
    # A trainer that writes one key name with new tags each step, syncs, samples the step and removes it got an
    # empty batch in 19 of 20 steps, and the tombstone kept every removed version of the name.
    with ReplayBuffer(source=SOURCES[source], source_kwargs={"path": db}, poll_interval=poll_interval) as rb:
        for step in range(1, 11):
            store.kv_put("k", "train", tag={"global_steps": step, "status": "success"})
            rb.sync(timeout=30)
            assert rb.sample("train", global_steps=step, timeout=5).keys == ["k"], step
            rb.remove("train", ["k"])
            assert max((len(tomb.versions) for tombs in rb._core.store.ledger._tombs.values()
                        for tomb in tombs.values()), default=0) <= 2
