"""The stream as a peer sees it: a hand-driven DEALER (the rogue peer of
:mod:`poller.faults.peer`) speaking the protocol to a real buffer, for
sequencing, resync, snapshots and hostile input."""

from __future__ import annotations

import logging

import pytest

from buffer import ReplayBuffer
from buffer.store import PartitionStore
from buffer.stream import StreamReceiver
from poller.faults.peer import RoguePeer as Peer
from poller.wire.protocol import Kind, encode_body, encode_header
from tests.conftest import alive as _alive
from tests.conftest import wait_until


@pytest.fixture
def rb():
    buffer = ReplayBuffer(bind="tcp://127.0.0.1:0")
    yield buffer
    buffer.close()

@pytest.fixture
def peer(rb):
    p = Peer(rb.endpoint)
    yield p
    p.close()

def test_a_snapshot_then_deltas_apply_and_a_new_snapshot_drops_what_vanished(rb, peer):
    peer.ready()
    peer.delta({"p": {"a": {"status": "running"}, "b": {"status": "success"}}}, full=True, reset=True)
    assert wait_until(lambda: rb.snapshot("p").keys() == {"a", "b"})
    peer.delta({"p": {"a": {"status": "success"}}}, {"p": ["b"]})
    assert wait_until(lambda: rb.snapshot("p") == {"a": {"status": "success"}})
    rb.add("p", {"local": {"status": "running"}})  # never listed by a source: kept
    peer.delta({"p": {"c": {"x": 1}}}, full=True, reset=True)  # "a" is gone from the store
    assert wait_until(lambda: rb.snapshot("p") == {"c": {"x": 1}, "local": {"status": "running"}})

def test_a_gap_asks_for_a_resync_and_stale_deltas_are_ignored_until_the_snapshot(rb, peer):
    peer.ready()
    peer.delta({"p": {"a": {"v": 1}}}, full=True, reset=True)
    assert wait_until(lambda: "a" in rb.snapshot("p"))
    peer.delta({"p": {"lost": {"v": 1}}}, seq=peer.seq + 3)  # seq jumps: something was lost
    request = peer.recv()
    assert request is not None and request.kind is Kind.RESYNC
    peer.delta({"p": {"stale": {"v": 1}}})  # not a snapshot: must be ignored
    peer.delta({"p": {"a": {"v": 2}, "fresh": {"v": 1}}}, full=True, reset=True)
    assert wait_until(lambda: rb.snapshot("p") == {"a": {"v": 2}, "fresh": {"v": 1}})

def test_an_unknown_epoch_mid_stream_asks_for_a_resync(rb, peer):
    peer.delta({"p": {"a": {"v": 1}}}, seq=5)  # no READY: we joined mid-stream
    asked = [peer.recv(), peer.recv()]
    # A standalone poller first heard of lists anew: the token its listing must answer, and a resync.
    assert [m.kind for m in asked if m is not None] == [Kind.SYNC, Kind.RESYNC]
    assert rb.snapshot("p") == {}

def test_replayed_sequence_numbers_are_counted_and_dropped(rb, peer):
    peer.ready()
    peer.delta({"p": {"a": {"v": 1}}}, full=True, reset=True)
    assert wait_until(lambda: "a" in rb.snapshot("p"))
    peer.delta({"p": {"a": {"v": 99}}}, seq=1)  # a replay of seq 1
    assert wait_until(lambda: rb.stats()["protocol_errors"] == 1)
    assert rb.snapshot("p") == {"a": {"v": 1}}

@pytest.mark.parametrize("frames", [
    [b"\xc1"],                                              # one frame, invalid msgpack
    [b"\x94\x01\x02", b"\x80"],                             # truncated header
    [encode_header(Kind.DELTA, 1, 0)[:-1] + b"\x00", b""],  # empty body
    [b"\x94\x09\x01\x01\x00", b"\x80"],                     # protocol version 9
    [b"\x94\x01\x63\x01\x00", b"\x80"],                     # unknown kind 99
    [encode_header(Kind.DELTA, 1, 0), encode_body(Kind.STOP, {"reason": "x"})],  # body of the wrong kind
    [encode_header(Kind.STOP, 1, 0), encode_body(Kind.STOP, {"reason": "x"})],   # wrong direction
    [b"x" * 1000, b"\x80"],                                 # oversized header
])
def test_malformed_input_is_counted_and_logged_and_the_stream_survives(rb, peer, frames, caplog):
    caplog.set_level(logging.WARNING, logger="buffer")
    peer.sock.send_multipart(frames)
    assert wait_until(lambda: rb.stats()["protocol_errors"] == 1)
    # The receiver thread counts, then logs: the record may follow the count by a moment.
    assert wait_until(lambda: any("protocol error" in r.getMessage() for r in caplog.records))
    peer.ready()
    peer.delta({"p": {"ok": {"v": 1}}}, full=True, reset=True)
    assert wait_until(lambda: rb.snapshot("p") == {"ok": {"v": 1}})

def test_poller_warnings_reach_the_trainers_poller_logger(caplog):
    caplog.set_level(logging.WARNING, logger="poller")
    rb = ReplayBuffer(source="tests.helpers.sources:Chatty", poll_interval=0.02)
    try:
        assert wait_until(lambda: any("chatty source says hello" in r.getMessage() for r in caplog.records))
        record = next(r for r in caplog.records if "chatty source says hello" in r.getMessage())
        assert record.name == "poller" and record.levelno == logging.WARNING
    finally:
        rb.close()

def test_a_dropped_buffer_is_closed_by_its_finalizer(db):
    import gc

    rb = ReplayBuffer(source="poller.sources.sqlite:SqliteSource", source_kwargs={"path": db}, poll_interval=0.05)
    pid = rb.stats()["poller_pid"]
    del rb
    gc.collect()
    assert wait_until(lambda: not _alive(pid), timeout=5)

def _receiver() -> tuple[StreamReceiver, PartitionStore, str]:
    store = PartitionStore()
    receiver = StreamReceiver(store, "tcp://127.0.0.1:0")
    return receiver, store, receiver.start()

@pytest.mark.parametrize("awaited_first", [True, False], ids=["awaited-then-applied", "applied-then-awaited"])
def test_the_receiver_ends_on_the_awaited_bye_and_runs_its_clean_up_once(awaited_first: bool):
    # Either order: a BYE applied before the receiver is told to await it still ends the thread.
    receiver, store, endpoint = _receiver()
    peer = Peer(endpoint)
    ran: list[str] = []

    def await_bye() -> None:
        receiver.stop_after_bye("rogue", peer.epoch, then=lambda: ran.append("clean-up"))

    try:
        peer.ready()
        if awaited_first:
            await_bye()
        peer.send(Kind.BYE, {"last_seq": peer.seq - 1, "reason": "STOP" if awaited_first else "SIGTERM"})
        assert receiver.wait_bye("rogue", peer.epoch, 5.0)  # applied, and no gap before it
        if not awaited_first:
            await_bye()
        assert wait_until(lambda: ran == ["clean-up"])
    finally:
        peer.close()
        receiver.stop()
        store.close()
    assert ran == ["clean-up"]  # once

def test_a_receiver_stopped_before_the_bye_does_not_run_the_clean_up():
    receiver, store, endpoint = _receiver()
    peer = Peer(endpoint)
    ran: list[str] = []
    try:
        peer.ready()
        receiver.stop_after_bye("rogue", peer.epoch, then=lambda: ran.append("clean-up"))
        peer.delta({"p": {"a": {"v": 1}}}, full=True, reset=True)
        assert wait_until(lambda: "a" in store.snapshot("p"))
    finally:
        peer.close()
        receiver.stop()
        store.close()
    assert ran == []
