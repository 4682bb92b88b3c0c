"""The watch: while a decision waits on a few keys, the poller reads them cheaply and lists once one changed.

Real poller processes, real ZeroMQ and a real SQLite file read without its change feed
(:class:`tests.helpers.sources.WatchedSqlite`, which offers ``kv_watch`` as TransferQueue's source
does). The poll schedule is made long (a 60 s ``poll_interval``), so only the
watch can bring a listing forward: a decision that returns within seconds was woken by it. What
the buffer shows is checked against the store itself: the watch decides when, never what.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import msgpack
import pytest

from buffer import ReplayBuffer
from buffer.verl import waiting
from poller.duty import ListingDuty
from poller.sources.sqlite import SqliteSource
from poller.wire.errors import ProtocolError
from poller.wire.protocol import MAX_WATCH_KEYS, Kind, Message, Watch, decode, encode_header
from tests.conftest import wait_until
from tests.helpers.messages import heartbeat, to_frames

WATCHED = "tests.helpers.sources:WatchedSqlite"
# Far longer than any wait below: a listing that comes sooner was brought forward by the watch (or a SYNC).
SLOW_SCHEDULE: dict[str, Any] = {"poll_interval": 60.0, "listing_share": 1.0}
# The other end: a listing as often as the poll schedule allows, no share held back.
FAST_SCHEDULE: dict[str, Any] = {"poll_interval": 0.01, "listing_share": 1.0}


def _finished(rb: ReplayBuffer, key: str) -> Callable[[], bool | None]:
    def attempt() -> bool | None:
        tags = rb.sampling.tags("train", [key]).get(key)
        return True if tags is not None and tags.get("status") == "finished" else None

    return attempt


# Seconds between a waiting decision's own listings in these tests: longer than any of them waits.
WAIT_LISTINGS = 60.0


def _decide_in_thread(rb: ReplayBuffer, attempt: Callable[[], bool | None], watch: Callable[[], list[str]] | None,
                      timeout: float) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            # With a watch, the decision waits as buffer.verl's calls do, its own listings WAIT_LISTINGS apart:
            # none falls within a test, so what lists sooner is the watch. Without one, the poller's schedule.
            if watch is None:
                outcome.append(rb.sampling.decide(attempt, partition_id="train", timeout=timeout,
                                                  describe=lambda: "test"))
            else:
                outcome.append(waiting.decide(rb.sampling, attempt, partition_id="train", timeout=timeout,
                                              describe=lambda: "test", log_every=None, what="test",
                                              poll_every=WAIT_LISTINGS, on_poll=lambda: None, version=None,
                                              watch=watch))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            outcome.append(exc)

    thread = threading.Thread(target=run, name="test-decide", daemon=True)
    thread.start()
    return thread, outcome


def _settle_listings(rb: ReplayBuffer) -> int:
    """The listings count once the heartbeats caught up with the applied polls."""
    time.sleep(1.5)  # one heartbeat interval and a margin
    return int(rb.stats()["listings"])


def test_a_change_to_a_watched_key_is_listed_at_once_and_the_view_is_the_stores(store: SqliteSource, db: str) -> None:
    store.kv_batch_put(["p", "q", "gone"], "train", tags=[{"status": "running"}, {"n": 1}, {"n": 2}])
    with ReplayBuffer(WATCHED, source_kwargs={"path": db}, **SLOW_SCHEDULE) as rb:
        assert rb.sampling.tags("train", ["p"])["p"]["status"] == "running"
        listings = _settle_listings(rb)
        thread, outcome = _decide_in_thread(rb, _finished(rb, "p"), lambda: ["p"], timeout=20.0)
        assert wait_until(lambda: rb.stats()["watch_reads"] >= 1, timeout=10.0)
        # Unwatched changes alone bring nothing forward; they come with the listing the watched one brings.
        store.kv_put("q", "train", tag={"n": 10})
        store.kv_clear(["gone"], "train")
        time.sleep(1.0)
        assert thread.is_alive(), outcome
        store.kv_put("p", "train", tag={"status": "finished"})
        thread.join(15.0)
        assert not thread.is_alive() and outcome == [True]
        # What the buffer shows is what the store holds: the unwatched changes came with it.
        assert rb.snapshot("train") == store.kv_list()["train"]
        assert wait_until(lambda: rb.stats()["watch_listings"] >= 1, timeout=5.0), rb.stats()
        assert _settle_listings(rb) == listings + 1


def test_a_change_before_the_watch_began_is_seen_by_its_first_read(store: SqliteSource, db: str) -> None:
    """The first read compares the keys with what the listings sent: a finish that landed after the last listing
    and before the watch began is listed at once, not with the next listing of the schedule."""
    store.kv_put("p", "train", tag={"status": "running"})
    with ReplayBuffer(WATCHED, source_kwargs={"path": db}, **SLOW_SCHEDULE) as rb:
        store.kv_put("p", "train", tag={"status": "finished"})  # the view still holds "running"
        thread, outcome = _decide_in_thread(rb, _finished(rb, "p"), lambda: ["p"], timeout=20.0)
        thread.join(15.0)
        assert outcome == [True]
        assert wait_until(lambda: rb.stats()["watch_listings"] == 1, timeout=5.0), rb.stats()


@pytest.mark.parametrize("schedule", [SLOW_SCHEDULE, FAST_SCHEDULE], ids=["slowest", "fastest"])
def test_with_a_watch_the_buffer_shows_what_the_store_holds_at_either_end_of_the_schedule(
        store: SqliteSource, db: str, schedule: dict[str, Any]) -> None:
    store.kv_batch_put(["p", "q", "gone"], "train", tags=[{"status": "running"}, {"n": 1}, {"n": 2}])
    with ReplayBuffer(WATCHED, source_kwargs={"path": db}, **schedule) as rb:
        thread, outcome = _decide_in_thread(rb, _finished(rb, "p"), lambda: ["p"], timeout=20.0)
        assert wait_until(lambda: rb.stats()["watch_reads"] >= 1, timeout=10.0)
        store.kv_put("q", "train", tag={"n": 10})
        store.kv_clear(["gone"], "train")
        store.kv_put("new", "train", tag={"n": 3})
        store.kv_put("p", "train", tag={"status": "finished"})
        thread.join(15.0)
        assert outcome == [True]
        rb.sync(timeout=10.0)
        assert rb.snapshot("train") == store.kv_list()["train"]
        assert "gone" not in rb.snapshot("train") and rb.snapshot("train")["q"] == {"n": 10}


def test_without_a_watch_the_same_wait_keeps_to_the_schedule(store: SqliteSource, db: str) -> None:
    """The control: the decision above, without ``watch``, is not answered before the deadline."""
    store.kv_put("p", "train", tag={"status": "running"})
    with ReplayBuffer(WATCHED, source_kwargs={"path": db}, **SLOW_SCHEDULE) as rb:
        thread, outcome = _decide_in_thread(rb, _finished(rb, "p"), None, timeout=4.0)
        time.sleep(0.5)
        store.kv_put("p", "train", tag={"status": "finished"})
        thread.join(15.0)
        assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError)
        assert rb.stats()["watch_reads"] == 0


def test_the_watch_ends_with_the_decision_and_a_failing_read_changes_nothing(store: SqliteSource, db: str) -> None:
    store.kv_put("p", "train", tag={"status": "running"})
    with ReplayBuffer(WATCHED, source_kwargs={"path": db}, **SLOW_SCHEDULE) as rb:
        thread, outcome = _decide_in_thread(rb, _finished(rb, "p"), lambda: ["p"], timeout=20.0)
        assert wait_until(lambda: rb.stats()["watch_reads"] >= 2, timeout=10.0)
        store.kv_put("p", "train", tag={"status": "finished"})
        thread.join(15.0)
        assert outcome == [True]
        time.sleep(1.5)
        reads = rb.stats()["watch_reads"]
        time.sleep(2.0)
        assert rb.stats()["watch_reads"] == reads  # the poller was told to stop reading
    with ReplayBuffer(WATCHED, source_kwargs={"path": db, "failing_watch": True}, **SLOW_SCHEDULE) as rb:
        store.kv_put("p", "train", tag={"status": "running"})
        rb.sync(timeout=10.0)
        thread, outcome = _decide_in_thread(rb, _finished(rb, "p"), lambda: ["p"], timeout=3.0)
        thread.join(15.0)
        assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError)
        rb.sync(timeout=10.0)  # polling goes on
        stats = rb.stats()
        assert stats["source_errors"] == 0 and stats["watch_reads"] == 0 and stats["poller_alive"]


def test_a_watch_lapses_in_the_poller_unless_renewed(store: SqliteSource, db: str) -> None:
    """A trainer that stops renewing (stopped, dead) leaves nothing read on its behalf for long."""
    store.kv_put("p", "train", tag={"status": "running"})
    with ReplayBuffer(WATCHED, source_kwargs={"path": db}, **SLOW_SCHEDULE) as rb:
        rb.sampling._listings.watch("train", ["p"], 1.0, 2.0)  # one WATCH, never renewed
        assert wait_until(lambda: rb.stats()["watch_reads"] >= 1, timeout=10.0)
        time.sleep(2.5)  # the watch lapsed; the last heartbeat counted every read
        reads = rb.stats()["watch_reads"]
        assert reads <= 1.0 / 0.3 + 2
        time.sleep(1.5)
        assert rb.stats()["watch_reads"] == reads


def test_watch_messages_cross_the_wire_and_bad_ones_are_refused() -> None:
    body = Watch("train", ["a", "b"], 3.0, 2.0)
    message = decode(to_frames(Message(Kind.WATCH, 5, 1, body)))
    assert message.kind is Kind.WATCH and message.body == body
    beat = heartbeat(watch_reads=7, watch_listings=2)
    assert decode(to_frames(Message(Kind.HEARTBEAT, 5, 2, beat))).body == beat
    for bad, match in (({"partition": "train", "keys": ["k"] * (MAX_WATCH_KEYS + 1), "seconds": 1.0}, "keys"),
                       ({"partition": "train", "keys": [1], "seconds": 1.0}, "keys"),
                       ({"partition": "train", "keys": ["k"], "seconds": -1.0}, "wrong value"),
                       ({"keys": ["k"], "seconds": 1.0}, "partition")):
        with pytest.raises(ProtocolError, match=match):
            decode([encode_header(Kind.WATCH, 5, 1), msgpack.packb(bad, use_bin_type=True)])


def test_a_change_brings_a_listing_forward_at_most_once_per_the_watchs_every() -> None:
    duty = ListingDuty(1.0)
    duty.record(100.0, 0.1)
    assert duty.wait_for(100.3) == 0.0 and duty.wait_for_change(2.0, 100.3) == 0.0
    duty.brought_forward(100.3)
    duty.record(100.3, 0.1)
    assert duty.wait_for_change(2.0, 101.0) == pytest.approx(1.3)  # one brought forward per `every`
    assert duty.wait_for(101.0) == 0.0  # a listing asked for (a SYNC) is not held back
    shared = ListingDuty(0.15)
    shared.record(10.0, 0.15)
    assert shared.wait_for_change(0.1, 10.5) == shared.wait_for(10.5) == pytest.approx(0.5)  # within the share


def test_a_waiting_decision_lists_at_its_own_times_whatever_the_watch_brought_forward(
        store: SqliteSource, db: str) -> None:
    # verl's sampler lists every poll_interval from the start of its wait; a listing the watch brings forward in
    # between must not push the decision's next one later (a change after it would be seen later than with verl).
    store.kv_put("p", "train", tag={"status": "running"})
    with ReplayBuffer(WATCHED, source_kwargs={"path": db}, **SLOW_SCHEDULE) as rb:
        asked: list[float] = []
        outcome: list[Any] = []
        started = time.monotonic()

        def run() -> None:
            try:
                outcome.append(waiting.decide(rb.sampling, _finished(rb, "p"), partition_id="train", timeout=20.0,
                                              describe=lambda: "test", log_every=None, what="test", poll_every=2.0,
                                              on_poll=lambda: asked.append(time.monotonic() - started),
                                              version=None, watch=lambda: ["p"]))
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                outcome.append(exc)

        thread = threading.Thread(target=run, name="test-decide", daemon=True)
        thread.start()
        time.sleep(1.0)
        store.kv_put("p", "train", tag={"note": "halfway"})  # watched, not what the decision waits for
        assert wait_until(lambda: rb.sampling.tags("train", ["p"]).get("p", {}).get("note") == "halfway", timeout=1.0)
        assert wait_until(lambda: len(asked) >= 1, timeout=10.0)
        store.kv_put("p", "train", tag={"status": "finished"})
        thread.join(15.0)
        assert not thread.is_alive() and outcome == [True]
    # Its own listing 2 s after the wait began, not 2 s after the one brought forward (at ~1-1.6 s).
    assert asked[0] < 2.7, asked


def test_the_buffer_sums_the_watch_counters_over_poller_processes_and_never_takes_one_back() -> None:
    from buffer.metrics import ListingFigures

    figures = ListingFigures()
    figures.report(1, listings=3, last_s=0.1, total_s=0.3, share=0.1, watch_reads=10, watch_listings=2)
    figures.report(1, listings=2, last_s=0.1, total_s=0.2, share=0.1, watch_reads=7, watch_listings=1)  # late beat
    assert (figures.listings, figures.total_s, figures.watch_reads, figures.watch_listings) == (3, 0.3, 10, 2)
    figures.report(2, listings=1, last_s=0.2, total_s=0.2, share=0.2, watch_reads=4, watch_listings=1)  # a restart
    assert (figures.listings, figures.watch_reads, figures.watch_listings) == (4, 14, 3)
    assert figures.total_s == pytest.approx(0.5) and (figures.last_s, figures.share) == (0.2, 0.2)
    assert all(type(n) is int for n in (figures.listings, figures.watch_reads, figures.watch_listings))
