"""Source stalls: a kv_list() past its deadline is counted, logged once per
episode, never fatal, and never keeps the poller from stopping."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from buffer import ReplayBuffer
from poller import PollerProcess, ProtocolError
from poller.wire.protocol import Kind, Message, as_map, decode
from tests.conftest import wait_until
from tests.helpers.messages import HEARTBEAT, to_frames
from tests.helpers.stalls import call_starts
from tests.test_stream import Peer


def _stall_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "source stall:" in r.getMessage()]


def test_stalls_the_source_reports_are_counted_and_logged_once_per_episode(caplog):
    caplog.set_level(logging.WARNING, logger="poller")
    # Seven stalls in two episodes; six in a row is more than the five
    # failures that end a poller, and a stall is not a failure.
    with ReplayBuffer(source="tests.helpers.stalls:ScriptedStalls", source_kwargs={"script": "SSSSSSLSL"},
                      poll_interval=0.02) as rb:
        assert wait_until(lambda: rb.stats()["source_stalls"] == 7 and rb.snapshot().get("train"), timeout=20)
        assert wait_until(lambda: len(_stall_warnings(caplog)) == 2, timeout=10)
        stats = rb.stats()
        assert stats["restarts"] == 0 and stats["poller_alive"] and stats["source_errors"] == 0
        assert rb.snapshot("train") == {"k": {"status": "success"}}
    assert len(_stall_warnings(caplog)) == 2
    assert "scripted store did not answer" in _stall_warnings(caplog)[0]


def test_a_call_stuck_forever_is_one_stall_and_stop_still_works(caplog):
    caplog.set_level(logging.WARNING, logger="poller")
    with ReplayBuffer(bind="tcp://127.0.0.1:0") as rb:
        poller = PollerProcess("poller.faults:hang", endpoint=rb.endpoint, name="stuck",
                               poll_interval=0.02, stall_timeout=0.3)
        poller.start(30)
        try:
            assert wait_until(lambda: rb.stats()["source_stalls"] == 1, timeout=20)
            time.sleep(1.0)  # the same call, still stuck: still one stall
            assert rb.stats()["source_stalls"] == 1
            assert wait_until(lambda: len(_stall_warnings(caplog)) == 1, timeout=10)
            assert "has not returned for" in _stall_warnings(caplog)[0]
        finally:
            report = poller.close(5)
        assert report.stage == "graceful" and report.exitcode == 0
        assert report.seconds < 5


def test_the_receiver_sums_stalls_over_poller_restarts():
    with ReplayBuffer(bind="tcp://127.0.0.1:0") as rb:
        peer = Peer(rb.endpoint, epoch=5)
        try:
            peer.ready(join=False)  # heartbeats only: no listing to make
            for count in (2, 3, 3):
                peer.send(Kind.HEARTBEAT, dict(HEARTBEAT, source_stalls=count, last_seq=peer.seq - 1))
            assert wait_until(lambda: rb.stats()["source_stalls"] == 3)
            peer.epoch, peer.seq = 6, 0  # a restarted poller counts from zero again
            peer.ready(join=False)
            peer.send(Kind.HEARTBEAT, dict(HEARTBEAT, source_stalls=1, last_seq=peer.seq - 1))
            assert wait_until(lambda: rb.stats()["source_stalls"] == 4)
            peer.send(Kind.HEARTBEAT, dict(HEARTBEAT, source_stalls=1, last_seq=peer.seq - 1))  # none new
            assert wait_until(lambda: rb.stats()["messages"] == 7)  # 2 READY and 5 HEARTBEAT
            assert rb.stats()["source_stalls"] == 4 and rb.stats()["protocol_errors"] == 0
        finally:
            peer.close()


def test_the_heartbeat_stall_count_is_required_and_checked():
    for body in (HEARTBEAT, dict(HEARTBEAT, source_stalls=12)):
        assert as_map(Kind.HEARTBEAT, decode(to_frames(Message(Kind.HEARTBEAT, 1, 1, body))).body) == body
    with pytest.raises(ProtocolError, match="lacks field 'source_stalls'"):
        to_frames(Message(Kind.HEARTBEAT, 1, 1, {k: v for k, v in HEARTBEAT.items() if k != "source_stalls"}))
    for bad in (-1, "3", 1.5, True, None):
        with pytest.raises(ProtocolError, match="source_stalls"):
            to_frames(Message(Kind.HEARTBEAT, 1, 1, dict(HEARTBEAT, source_stalls=bad)))


STALL_S = 3.0  # a store that stops answering: the call gives up after this long (TransferQueue's call_timeout)
SLACK_S = 1.5  # the answering call, its delivery and a loaded machine


def _seen_after_a_stall(tmp_path: Path, ask_every: float | None, **options: object) -> float:
    """Seconds from the start of a stalled call to the buffer showing the store's next answer.

    The store answers, stalls once (``STALL_S``), then answers again. With
    ``ask_every`` a thread asks ``sync()`` that often, as a waiting verl sampler does.
    """
    log = str(tmp_path / "calls.log")
    stop = threading.Event()
    with ReplayBuffer("tests.helpers.stalls:TimedStalls", source_kwargs={"log": log, "script": "LS",
                                                                           "seconds": STALL_S},
                      **options) as rb:  # type: ignore[arg-type]
        def ask() -> None:
            while not stop.is_set():
                try:
                    rb.sync(timeout=2.0)  # a waiting call's wait-poll bound: asked again after a stall
                except TimeoutError:
                    continue
                except BaseException:  # noqa: BLE001 - closed: the test is over
                    return
                stop.wait(ask_every)

        asker = threading.Thread(target=ask, name="test-sync-every", daemon=True)
        if ask_every is not None:
            asker.start()
        try:
            assert wait_until(lambda: rb.snapshot().get("train", {}).get("k", {}).get("answers") == 2,
                              timeout=60, interval=0.005)
            seen = time.monotonic()
            assert rb.stats()["source_stalls"] == 1
        finally:
            stop.set()
    if ask_every is not None:
        asker.join(10)
    stalled = [when for when, step in call_starts(log) if step == "S"]
    assert len(stalled) == 1
    return seen - stalled[0]


def test_after_a_stall_the_generic_buffer_asks_again_one_poll_interval_later(tmp_path: Path) -> None:
    # Default settings: the next call comes poll_interval after the stalled one gave up (docs/using.md). On
    # d03d3b3 verl's cycle took the stalled call for a listing: 2 x 3 s + 2 s after it began.
    seen = _seen_after_a_stall(tmp_path, None, poll_interval=0.5)
    assert seen <= STALL_S + 0.5 + SLACK_S, seen


def test_after_a_stall_a_buffer_asked_to_sync_lists_again_at_once(tmp_path: Path) -> None:
    # buffer.verl's rhythm: a poller that lists only when asked (a SYNC while a call waits), no listing share.
    # The stalled call is not a listing and leaves no pause behind it: the next SYNC is answered by a listing
    # that begins at once, not poll_interval nor the stall's length later (d03d3b3 waited 2 s + its duration).
    seen = _seen_after_a_stall(tmp_path, 0.02, poll_interval=3600.0, listing_share=1.0)
    assert seen <= STALL_S + SLACK_S, seen
