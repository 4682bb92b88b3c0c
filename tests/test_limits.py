"""Bounds against a hostile or broken peer: decoding limits, the per-peer state
cap, and the liveness bound (``stale_after``), through a real buffer."""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from buffer import ReplayBuffer
from poller.faults.peer import packed_delta
from poller.wire.errors import ProtocolError
from poller.wire.protocol import DEFAULT_LIMITS, Kind, Limits, Message, decode
from poller.wire.tags import unpack_many_tags
from tests.conftest import wait_until
from tests.helpers.messages import HEARTBEAT, to_frames
from tests.test_stream import Peer


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _delta(upserts: dict[str, Any], deletes: dict[str, Any] | None = None) -> list[bytes]:
    return to_frames(Message(Kind.DELTA, 1, 1, packed_delta(upserts, deletes)))


def _received(frames: list[bytes], limits: Limits = DEFAULT_LIMITS) -> None:
    """What the buffer checks of a message: its frames, then (a DELTA) each key's packed tags as it unpacks them."""
    message = decode(frames, limits)
    if message.kind is Kind.DELTA:
        for _, blobs in message.body.packed.values():
            unpack_many_tags(blobs, limits)


def test_limits_validate_their_values() -> None:
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="max_peers"):
            Limits(max_peers=bad)  # type: ignore[arg-type]


def test_keys_per_message_counts_partitions_upserts_and_deletes() -> None:
    limits = Limits(max_keys_per_message=5)
    decode(_delta({"p": {"a": {}, "b": {}}}, {"q": ["c"]}), limits)  # 2 partitions + 3 keys
    with pytest.raises(ProtocolError, match="more than 5"):
        decode(_delta({"p": {"a": {}, "b": {}}}, {"q": ["c", "d"]}), limits)


@pytest.mark.parametrize("kind, body", [
    (Kind.DELTA, lambda v: packed_delta({"p": {"k": {"deep": v}}})),
    (Kind.DELTA, lambda v: {**packed_delta({}, sync=0)._asdict(), "extra": v}),
    (Kind.HEARTBEAT, lambda v: {**HEARTBEAT, "extra": v}),
])
def test_nesting_is_bounded_in_every_body(kind: Kind, body: Any) -> None:
    limits = Limits(max_depth=8)
    _received(to_frames(Message(kind, 1, 1, body(_nested(3)))), limits)
    with pytest.raises(ProtocolError, match="deeper than 8"):
        _received(to_frames(Message(kind, 1, 1, body(_nested(9)))), limits)


def test_default_nesting_bound_keeps_snapshot_safe() -> None:
    # msgpack itself would accept ~1000 levels, enough to break deepcopy in snapshot().
    frames = _delta({"p": {"k": {"v": _nested(200)}}})
    with pytest.raises(ProtocolError, match="deeper than 32"):
        _received(frames)


@pytest.fixture
def limited() -> Iterator[ReplayBuffer]:
    rb = ReplayBuffer(bind="tcp://127.0.0.1:0",
                      limits=Limits(max_keys_per_message=4, max_depth=8, max_str_len=64, max_frame_bytes=4096,
                                    max_peers=3),
                      stale_after=0.5)
    yield rb
    rb.close()


def test_the_buffer_applies_its_configured_limits(limited: ReplayBuffer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="buffer")
    peer = Peer(limited.endpoint)
    try:
        peer.ready()
        # Too deep: found as its tags are unpacked (the first message, in sequence), it asks for a resync.
        peer.delta({"p": {"k": {"v": _nested(10)}}})
        peer.delta({"p": {f"k{i}": {} for i in range(4)}}, full=True, reset=True)   # 5 > 4
        peer.delta({"p": {"k": {"v": "x" * 100}}})                                  # string too long
        assert wait_until(lambda: limited.stats()["protocol_errors"] == 3)
        # The refused tags are named by their partition (the store unpacks them, the log says where).
        assert any("deeper than 8 (key of partition 'p')" in r.getMessage() for r in caplog.records), caplog.text
        peer.delta({"p": {"lost": {"v": 1}}})
        request = peer.recv()  # the dropped messages left a gap: the buffer asks for a snapshot
        assert request is not None and request.kind is Kind.RESYNC
        peer.delta({"p": {"ok": {"v": 1}}}, full=True, reset=True)
        assert wait_until(lambda: limited.snapshot() == {"p": {"ok": {"v": 1}}})
        # A frame past max_frame_bytes is refused by libzmq before it is read:
        # the buffer hangs up on the sender, and the decoder never sees it.
        monitor = peer.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            errors = limited.stats()["protocol_errors"]
            peer.sock.send_multipart([b"h", b"x" * 5000])
            assert monitor.poll(10_000), "the buffer did not drop the sender of an oversized frame"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            assert limited.stats()["protocol_errors"] == errors
        finally:
            peer.sock.disable_monitor()
            monitor.close(0)
    finally:
        peer.close()


def test_per_peer_state_is_capped(limited: ReplayBuffer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="buffer")
    peers = [Peer(limited.endpoint, name=f"peer{i}".encode(), epoch=10 + i) for i in range(6)]
    try:
        for i, peer in enumerate(peers):
            peer.ready()
            peer.delta({f"part{i}": {"k": {"v": i}}}, full=True, reset=True)
            assert wait_until(lambda: f"part{i}" in limited.snapshot())
        assert limited.stats()["peers"] == 3
        assert any("forgot the state of peer" in r.getMessage() for r in caplog.records)
        # A forgotten peer is withdrawn: what only it listed is dropped (nothing vouches for it any more).
        assert "part0" not in limited.snapshot()
        # Speaking again, it is asked to list anew (a token, then a resync), not trusted mid-stream.
        peers[0].delta({"part0": {"k": {"v": 99}}})
        asked = [peers[0].recv(), peers[0].recv()]
        assert [m.kind for m in asked if m is not None] == [Kind.SYNC, Kind.RESYNC]  # the token first
        assert "part0" not in limited.snapshot()
    finally:
        for peer in peers:
            peer.close()


def test_a_silent_peer_is_reported_stale_then_back(limited: ReplayBuffer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="buffer")
    peer = Peer(limited.endpoint, name=b"quiet")
    try:
        peer.ready()
        assert wait_until(lambda: limited.stats()["peers"] == 1)
        assert limited.stats()["stale_peers"] == []
        assert wait_until(lambda: limited.stats()["stale_peers"] == ["quiet"], timeout=5)
        assert wait_until(lambda: any("no message from poller quiet" in r.getMessage() for r in caplog.records))
        peer.send(Kind.HEARTBEAT, dict(HEARTBEAT, last_seq=peer.seq - 1))
        assert wait_until(lambda: limited.stats()["stale_peers"] == [])
        # A peer that said BYE left on purpose: it is not stale.
        peer.send(Kind.BYE, {"last_seq": peer.seq - 1, "reason": "done"})
        time.sleep(1.0)
        assert limited.stats()["stale_peers"] == []
    finally:
        peer.close()


def test_the_buffers_own_poller_sends_within_the_buffers_limits(store) -> None:
    # 300 keys in one listing; the buffer accepts 20 partitions-plus-keys per message.
    store.kv_batch_put([f"k{i}" for i in range(300)], "train", tags=[{"status": "success"}] * 300)
    rb = ReplayBuffer("poller.sources.sqlite:SqliteSource", source_kwargs={"path": store.path}, poll_interval=0.05,
                      limits=Limits(max_keys_per_message=20, max_frame_bytes=4096))
    try:
        assert wait_until(lambda: len(rb.snapshot("train")) == 300)
        stats = rb.stats()
        assert stats["protocol_errors"] == 0 and stats["messages"] >= 30
    finally:
        rb.close()


def test_the_buffers_own_poller_checks_tags_against_the_buffers_limits(db: str, store: Any) -> None:
    """Regression: only the frame size reached the poller, so a tag the receiver refuses
    (here a string over max_str_len) went out, was refused, and every resync sent it again.
    Checked against the buffer's limits, the key is quarantined and the rest flows."""
    store.kv_put("k", "p", tag={"v": "x" * 100})
    store.kv_put("fine", "p", tag={"status": "success"})
    with ReplayBuffer("poller.sources.sqlite:SqliteSource", source_kwargs={"path": db}, poll_interval=0.05,
                      max_restarts=0, limits=Limits(max_str_len=64)) as rb:
        assert rb.sample("p", batch_size=1, timeout=20).keys == ["fine"]
        assert wait_until(lambda: rb.stats()["quarantined"] == 1)
        (partition, key, why), = rb.stats()["quarantined_keys"]
        assert (partition, key) == ("p", "k") and "exceeds max_str_len=64" in why
        assert rb.stats()["protocol_errors"] == 0 and rb.stats()["source_errors"] == 0
