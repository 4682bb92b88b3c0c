"""The listing share: full listings of a store without a change feed take a bounded share of the wall clock.

Real poller processes, real ZeroMQ. The source (:class:`tests.helpers.sources.TimedListing`)
takes a known time per ``kv_list()`` and logs when each call began, so the tests count
listings and check the gap between their starts; the poller times the same call from outside,
so its ``d`` is at least the source's and the bound checked here (the source's ``d / share``)
is the safe side of the one it keeps.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import msgpack
import pytest

from buffer import BufferClosed, ReplayBuffer
from buffer.verl.config import SamplerConfig, VerlConfigError
from poller.cli import main as poller_main
from poller.common.checks import DEFAULT_LISTING_SHARE
from poller.duty import ListingDuty
from poller.polling import PollingThread
from poller.reader import ListingReader
from poller.sources.contract import SourceStall
from poller.wire.errors import ProtocolError
from poller.wire.protocol import DEFAULT_LIMITS, Kind, Message, Sync, decode, encode_header
from tests.conftest import wait_until
from tests.helpers.deltas import read
from tests.helpers.gaps import lose_a_message
from tests.helpers.messages import HEARTBEAT, heartbeat, to_frames
from tests.helpers.sources import TimedListing, listing_starts

TIMED = "tests.helpers.sources:TimedListing"
SQLITE = "poller.sources.sqlite:SqliteSource"
LISTED_SQLITE = "tests.helpers.sources:ListedSqlite"


def _sync_every(rb: ReplayBuffer, gap: float, stop: threading.Event, answered: list[int],
                errors: list[BaseException]) -> threading.Thread:
    """A thread that asks ``rb.sync()`` every ``gap`` seconds, as a waiting verl sampler does."""
    def run() -> None:
        while not stop.is_set():
            try:
                rb.sync(timeout=30)
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)
                return
            answered.append(1)
            stop.wait(gap)

    thread = threading.Thread(target=run, name="test-sync-every", daemon=True)
    thread.start()
    return thread


def _gaps_while_syncs_ask_every_20ms(tmp_path: Path, seconds: float, listings: int, syncs: int,
                                     **options: object) -> list[float]:
    """Gaps between listing starts of a source taking ``seconds`` a listing while ``sync()`` asks every 20 ms.

    Waits for ``listings`` listings and ``syncs`` answered syncs; every sync asked is answered.
    """
    log = str(tmp_path / "listings.log")
    stop, answered, errors = threading.Event(), [], []
    with ReplayBuffer(TIMED, source_kwargs={"log": log, "seconds": seconds}, poll_interval=0.02,
                      **options) as rb:  # type: ignore[arg-type]
        asker = _sync_every(rb, 0.02, stop, answered, errors)
        try:
            # A window of listings: enough starts to see the gaps the share allows.
            assert wait_until(lambda: len(listing_starts(log)) >= listings, timeout=60)
            assert wait_until(lambda: len(answered) >= syncs, timeout=30), errors
        finally:
            stop.set()
            asker.join(35)
        assert not errors
    starts = [when for when, _ in listing_starts(log)]
    return [later - earlier for earlier, later in zip(starts, starts[1:])]


def test_listings_keep_to_the_share_while_syncs_ask_every_20ms(tmp_path: Path) -> None:
    seconds, share = 0.05, 0.25  # each listing is followed by the next no sooner than 0.2 s after it began
    # Every sync asked is answered by a listing: none is dropped while the share holds it back.
    gaps = _gaps_while_syncs_ask_every_20ms(tmp_path, seconds, listings=8, syncs=5, listing_share=share)
    assert min(gaps) >= seconds / share, gaps


def test_by_default_a_cheap_store_without_a_change_feed_is_listed_every_poll_interval(store, db: str) -> None:
    # poll_interval is the interval: a real SQLite file read without its change feed (a listing of ~1 ms), every
    # other option at its default, shows each change within one poll_interval and a listing. (d03d3b3 held every
    # listing to verl's 2 s cycle whatever poll_interval said: a change took 1.6 s at the median.)
    store.kv_list()  # the file and its schema exist before the poller opens it
    with ReplayBuffer(LISTED_SQLITE, source_kwargs={"path": db}, poll_interval=0.1) as rb:
        assert wait_until(lambda: rb.stats()["polls"] >= 1, timeout=30)
        took = []
        for step in range(20):
            time.sleep(random.uniform(0, 0.1))  # a random phase against the poll schedule
            written = time.monotonic()
            store.kv_put(f"k{step}", "train", tag={"global_steps": step, "status": "success"})
            assert wait_until(lambda key=f"k{step}": key in rb.snapshot("train"), timeout=30, interval=0.005)
            took.append(time.monotonic() - written)
            # Expected ~0.05 s each (0.1 s at most) and the listing; 0.6 s leaves room for a loaded machine.
            assert took[-1] < 0.6, [round(t, 3) for t in took]
        assert rb.stats()["snapshots"] == 1  # every change came with a poll of its own, not a resync


def test_by_default_an_expensive_listing_keeps_to_the_default_share(tmp_path: Path) -> None:
    # Listings of 0.1 s at poll_interval 0.02 s with syncs asked every 20 ms: the default share (0.15) holds each
    # next listing back to d / 0.15 after the last one began.
    seconds = 0.1
    gaps = _gaps_while_syncs_ask_every_20ms(tmp_path, seconds, listings=6, syncs=3)
    assert min(gaps) >= seconds / DEFAULT_LISTING_SHARE, gaps


def test_a_fixed_share_times_the_next_listing_from_the_start_of_the_last() -> None:
    fixed = ListingDuty(0.25)
    fixed.record(started=100.0, seconds=0.3)
    assert fixed.wait_for(now=100.8) == pytest.approx(0.4)  # d / share after the start, however long the poll
    default = ListingDuty(DEFAULT_LISTING_SHARE)
    default.record(started=100.0, seconds=0.001)  # a cheap listing: the poll schedule alone decides
    assert default.wait_for(now=100.01) == 0


def test_a_call_that_stalls_or_fails_is_not_a_listing_and_never_lengthens_the_next_wait(tmp_path: Path) -> None:
    # TransferQueue's call gives up after call_timeout (10 s): the store did not answer, so its 10 s are not a
    # listing's d; the next listing is left to the poll schedule.
    log = str(tmp_path / "listings.log")
    failing = TimedListing(log, seconds=0.0, stall=True)
    reader = ListingReader(failing, listing_share=0.01, stall_timeout=None)
    with pytest.raises(SourceStall):
        reader.read({}, True, limits=DEFAULT_LIMITS, size=4096)
    assert reader.duty.listings == 0 and reader.duty.wait_for() == 0


@pytest.mark.parametrize("share", [0.25, 1.0])
def test_stalled_calls_are_counted_as_stalls_not_as_listings(tmp_path: Path, share: object) -> None:
    log = str(tmp_path / "listings.log")
    with ReplayBuffer(TIMED, source_kwargs={"log": log, "seconds": 0.05, "stall": True}, poll_interval=0.02,
                      listing_share=share, start_timeout=30) as rb:  # type: ignore[arg-type]
        assert wait_until(lambda: rb.stats()["source_stalls"] >= 3, timeout=30)
        assert rb.stats()["listings"] == 0 and rb.stats()["listing_seconds_total"] == 0


def test_a_call_answered_past_stall_timeout_is_a_stall_not_a_listing(tmp_path: Path) -> None:
    # A store that hung 0.3 s (past a stall_timeout of 0.2 s) and then answered: counted as a listing of 0.3 s,
    # a share of 0.001 would hold the next one back 300 s.
    reader = ListingReader(TimedListing(str(tmp_path / "listings.log"), seconds=0.3), listing_share=0.001,
                           stall_timeout=0.2)
    assert read(reader, {}, True).upserts == {"train": {"train-key": {"global_steps": 1, "status": "success"}}}
    assert reader.duty.listings == 0 and reader.wait_for() == 0


def test_a_sync_asked_during_the_hold_is_answered_by_the_next_listing(tmp_path: Path) -> None:
    log = str(tmp_path / "listings.log")
    with ReplayBuffer(TIMED, source_kwargs={"log": log, "seconds": 0.1}, poll_interval=60.0,
                      listing_share=0.1) as rb:
        for _ in range(3):  # each one lands in the hold of the listing before (1 s)
            rb.sync(timeout=30)
        assert rb.stats()["polls"] == 4  # the first listing, then exactly one per sync
    starts = [when for when, _ in listing_starts(log)]
    assert len(starts) == 4
    assert all(later - earlier >= 0.1 / 0.1 for earlier, later in zip(starts, starts[1:]))


def test_stop_is_answered_at_once_while_the_share_holds_the_next_listing(tmp_path: Path) -> None:
    log = str(tmp_path / "listings.log")
    # One 0.2 s listing at a share of 0.001: the next may start only 200 s later.
    rb = ReplayBuffer(TIMED, source_kwargs={"log": log, "seconds": 0.2}, poll_interval=0.02,
                      listing_share=0.001, close_timeout=5.0)
    stop, answered, errors = threading.Event(), [], []
    asker = _sync_every(rb, 0.02, stop, answered, errors)
    try:
        assert wait_until(lambda: rb.stats()["listings"] >= 1, timeout=10)
    finally:
        report = rb.close()
        stop.set()
        asker.join(10)
    # STOP was answered by the poller itself (BYE), well within close_timeout, not by terminate().
    assert report.stage == "graceful" and report.exitcode == 0
    assert not asker.is_alive() and len(errors) == 1 and isinstance(errors[0], BufferClosed)
    assert answered == [] and len(listing_starts(log)) == 1


def test_stats_and_metrics_carry_the_listings(tmp_path: Path) -> None:
    log = str(tmp_path / "listings.log")
    seconds = 0.05
    with ReplayBuffer(TIMED, source_kwargs={"log": log, "seconds": seconds}, poll_interval=0.05,
                      listing_share=0.5) as rb:
        assert wait_until(lambda: rb.stats()["listings"] >= 3, timeout=30)  # heartbeats carry them
        stats = rb.stats()
        assert stats["listing_seconds"] >= seconds
        assert stats["listing_seconds_total"] >= stats["listings"] * seconds
        assert 0 < stats["listing_share"] <= 0.5 + 0.05  # measured up to now: a listing may be under way
        metrics = rb.metrics()
        assert metrics["replay.source.listings"] == float(stats["listings"])
        assert metrics["replay.source.last_listing_seconds"] == stats["listing_seconds"]
        assert metrics["replay.source.listing_seconds"] == stats["listing_seconds_total"]
        assert metrics["replay.source.listing_share"] == stats["listing_share"]
        # A poller restart starts its own figures from 0; the buffer's counters never go back.
        before = rb.stats()
        os.kill(before["poller_pid"], signal.SIGKILL)
        assert wait_until(lambda: rb.stats()["restarts"] == 1 and rb.stats()["epoch"] != before["epoch"],
                          timeout=30)
        assert wait_until(lambda: rb.stats()["listings"] > before["listings"], timeout=30)
        after = rb.stats()
        assert after["listing_seconds_total"] > before["listing_seconds_total"]


def test_a_change_feed_is_read_without_the_share(store, db: str) -> None:
    store.kv_list()  # the file and its schema exist before the poller opens it
    # A share so small that a second full listing would wait for minutes: syncs are read from the feed.
    with ReplayBuffer(SQLITE, source_kwargs={"path": db}, poll_interval=60.0, listing_share=0.0001) as rb:
        for step in range(5):
            store.kv_put(f"k{step}", "train", tag={"global_steps": step, "status": "success"})
            rb.sync(timeout=30)
            assert f"k{step}" in rb.snapshot("train")
        assert wait_until(lambda: rb.stats()["listings"] == 1, timeout=10)  # the first snapshot only
        assert rb.stats()["polls"] == 6


def test_the_source_lists_the_partitions_a_sync_names_also_after_a_restart(tmp_path: Path) -> None:
    log = str(tmp_path / "listings.log")
    kwargs = {"log": log, "stored": ["train", "val", "other"], "partition_ids": ["train"]}
    with ReplayBuffer(TIMED, source_kwargs=kwargs, poll_interval=60.0, listing_share=1.0) as rb:
        assert set(rb.snapshot()) == {"train"}
        rb.include_partitions(["val"])
        rb.sync(timeout=30)
        assert set(rb.snapshot()) == {"train", "val"}
        rb.include_partitions(["train", "val"])  # nothing new: nothing changes
        with pytest.raises(TypeError):
            rb.include_partitions("val")
        # A restarted poller lists both from its first listing: its snapshot keeps "val".
        first = rb.stats()
        os.kill(first["poller_pid"], signal.SIGKILL)
        assert wait_until(lambda: rb.stats()["snapshots"] > first["snapshots"], timeout=30)
        assert set(rb.snapshot()) == {"train", "val"}
    assert all(listed in (["train"], ["train", "val"]) for _, listed in listing_starts(log))
    assert listing_starts(log)[-1][1] == ["train", "val"]


def test_a_source_without_partition_ids_is_left_as_it_is(tmp_path: Path) -> None:
    log = str(tmp_path / "listings.log")
    with ReplayBuffer(TIMED, source_kwargs={"log": log, "stored": ["train", "val"]}, poll_interval=60.0,
                      listing_share=1.0) as rb:
        rb.include_partitions(["val", "other"])
        rb.sync(timeout=30)
        assert set(rb.snapshot()) == {"train", "val"}


# -- the option where it enters, and the wire ---------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan"), float("inf"), True, "0.1", None, "verl"])
def test_a_share_outside_0_to_1_is_refused_where_it_enters(bad: object) -> None:
    with pytest.raises(ValueError, match="listing_share"):
        ReplayBuffer(TIMED, source_kwargs={"log": "/nonexistent"}, listing_share=bad)  # type: ignore[arg-type]


def test_buffer_verl_takes_no_schedule_knob_but_poll_interval() -> None:
    # Its calls keep verl's own sampler's schedule: the share, a separate wait interval and listings between
    # calls are not options of its.
    for name in ("listing_share", "wait_poll_interval", "list_between_calls"):
        with pytest.raises(VerlConfigError, match="unknown sampler_kwargs"):
            SamplerConfig.resolve(asynchronous=False, trainer_mode="sync", max_off_policy_threshold=None,
                                  max_off_policy_strategy="drop", sampler_kwargs={name: 0.5},
                                  refill_fn=None, given={})


def test_the_cli_takes_and_checks_listing_share(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "fast", "None"):
        assert poller_main(["run", "--source", TIMED, "--connect", "tcp://127.0.0.1:1", "--listing-share", bad]) == 2
        assert "--listing-share" in capsys.readouterr().err
    # A share that passes the check; the source (no log given) is what then fails to start.
    assert poller_main(["run", "--source", TIMED, "--connect", "tcp://127.0.0.1:1", "--listing-share", "0.5"]) == 2
    assert "--listing-share" not in (err := capsys.readouterr().err) and "cannot start poller" in err
    poller_main(["run", "--help"])
    assert "--listing-share" in capsys.readouterr().out


def test_sync_partitions_and_heartbeat_listing_figures_cross_the_wire() -> None:
    sync = Message(Kind.SYNC, 5, 1, Sync(3, ["train", "val"], False))
    assert decode(to_frames(sync)).body == Sync(3, ["train", "val"], False)
    beat = heartbeat(listings=2, listing_s=0.25, listing_total_s=0.5, listing_share=0.01)
    assert decode(to_frames(Message(Kind.HEARTBEAT, 5, 2, beat))).body == beat


@pytest.mark.parametrize("kind, body, match", [
    (Kind.SYNC, {"token": 1, "mark": False, "partitions": "train"}, "partitions"),
    (Kind.SYNC, {"token": 1, "mark": False, "partitions": [""]}, "partitions"),
    (Kind.SYNC, {"token": 1, "mark": False, "partitions": [1]}, "partitions"),
    (Kind.SYNC, {"token": 1, "mark": False, "partitions": ["p"] * 1025}, "partitions"),
    (Kind.HEARTBEAT, {**HEARTBEAT, "listing_share": 1.5},
     "wrong value"),
    (Kind.HEARTBEAT, {**HEARTBEAT, "listing_s": -1.0},
     "wrong value"),
    (Kind.HEARTBEAT, {**HEARTBEAT, "listings": 1.0},
     "wrong type"),
])
def test_the_decoder_refuses_bad_listing_fields(kind: Kind, body: dict[str, object], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode([encode_header(kind, 5, 1), msgpack.packb(body, use_bin_type=True)])


@pytest.mark.parametrize("share, reconciled", [(1.0, True), (1e-6, False)])
def test_a_reconciliation_of_a_change_feed_waits_for_the_share(store, share: float, reconciled: bool) -> None:
    store.kv_put("k0", "train", tag={"status": "running"})
    reader = ListingReader(store, listing_share=share)
    reader.reconcile_interval = 0.0  # a reconciliation always due
    sent: dict = {}
    read(reader, sent, True, commit=True)
    assert reader.wait_for() == 0  # a feed is never held, for a snapshot or not
    store.kv_put("k1", "train", tag={"status": "running"})
    diff = read(reader, sent, False)
    # At share 1e-6 the next full listing may start only ~10^6 listings' time later: the feed is read instead.
    assert diff.diff.complete is reconciled
    assert diff.upserts == {"train": {"k1": {"status": "running"}}}
    assert reader.duty.listings == (2 if reconciled else 1)


def test_a_resync_sends_the_last_poll_again_without_a_listing(tmp_path: Path) -> None:
    log = str(tmp_path / "listings.log")
    bodies: list[tuple[Kind, bytes, bool]] = []

    def emit(kind: Kind, body: bytes, first: bool, stopping: threading.Event) -> bool:
        bodies.append((kind, body, first))
        return True

    # A share of 0.001: after its first listing the source may be listed again only ~50 s later.
    thread = PollingThread(TimedListing(log, seconds=0.05), emit, poll_interval=60.0, listing_share=0.001)
    thread.start()
    try:
        assert wait_until(lambda: thread.polls == 1, timeout=10)
        thread.request_sync(1)  # asked after the first listing began: only a later listing answers it
        thread.request_resync()
        assert wait_until(lambda: len(bodies) == 2, timeout=10)
    finally:
        thread.stop()
        thread.join(10)
    assert not thread.is_alive()
    first, again = (decode([encode_header(Kind.DELTA, 1, i), body]).body for i, (_, body, _) in enumerate(bodies))
    assert [starts for _, _, starts in bodies] == [True, True]
    # The same poll, whole: its number, start and sync token, and what it listed.
    assert again.full and again.reset and again.end and again.poll == first.poll == 1
    assert again.t == first.t and again.sync == first.sync == 0
    assert again.packed == first.packed == {"train": [["train-key"], [msgpack.packb(
        {"global_steps": 1, "status": "success"})]]}
    assert len(listing_starts(log)) == 1 and thread.polls == 1


def test_after_a_resync_is_answered_the_next_listing_keeps_to_the_poll_schedule(tmp_path: Path) -> None:
    """A RESYNC answered from what was sent is no listing asked for: the next listing is still due an interval on."""
    log = str(tmp_path / "listings.log")
    bodies: list[bytes] = []

    def emit(kind: Kind, body: bytes, first: bool, stopping: threading.Event) -> bool:
        bodies.append(body)
        return True

    thread = PollingThread(TimedListing(log, seconds=0.0), emit, poll_interval=60.0, listing_share=1.0)
    thread.start()
    try:
        assert wait_until(lambda: thread.polls == 1, timeout=10)
        thread.request_resync()
        assert wait_until(lambda: len(bodies) >= 2, timeout=10)
        time.sleep(1.0)
        assert (len(listing_starts(log)), thread.polls, len(bodies)) == (1, 1, 2)
    finally:
        thread.stop()
        thread.join(10)
    assert not thread.is_alive()


def test_a_buffer_repaired_by_a_resync_holds_the_last_poll_while_the_share_holds_the_next(tmp_path: Path) -> None:
    log = str(tmp_path / "listings.log")
    with ReplayBuffer(TIMED, source_kwargs={"log": log, "seconds": 0.05}, poll_interval=60.0,
                      listing_share=0.001) as rb:
        assert wait_until(lambda: rb.stats()["polls"] == 1, timeout=10)
        before = rb.stats()["snapshots"]
        lose_a_message(rb)  # the buffer asks a RESYNC
        # Answered at once, ~50 s before the share would allow a listing.
        assert wait_until(lambda: rb.stats()["snapshots"] == before + 1, timeout=10)
        assert rb.snapshot() == {"train": {"train-key": {"global_steps": 1, "status": "success"}}}
        assert rb.sample("train", batch_size=1, timeout=5).keys == ["train-key"]  # a whole view again
    assert len(listing_starts(log)) == 1
