"""The receiver's peer state machine, without ZeroMQ: messages in, actions out.

Time is passed in, so liveness and retries are checked without sleeping.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import pytest

from buffer.ratelimit import LogLimiter, clamp_level
from buffer.store import PartitionStore
from buffer.stream import RESYNC_RETRY_S, PeerTable, Send
from poller.faults.peer import packed_delta
from poller.wire.protocol import Ack, Delta, Kind, Limits, Log, Message, Ready

ID = b"p1"
EPOCH = 41
from tests.helpers import messages
from tests.helpers.messages import to_frames


def ready(seq: int = 0, epoch: int = EPOCH) -> Message:
    return Message(Kind.READY, epoch, seq, Ready(7, "p1", 0.1))


def delta(seq: int, upserts: dict[str, Any], *, full: bool = False, reset: bool = False, end: bool = True,
          deletes: dict[str, list[str]] | None = None, epoch: int = EPOCH, sync: int = 0) -> Message:
    return Message(Kind.DELTA, epoch, seq, packed_delta(upserts, deletes, poll=seq, full=full, reset=reset, end=end,
                                                        sync=sync))


def heartbeat(seq: int, last_seq: int | None = None, epoch: int = EPOCH) -> Message:
    """A HEARTBEAT at ``seq`` saying the last message before it was ``last_seq`` (default: ``seq - 1``)."""
    return Message(Kind.HEARTBEAT, epoch, seq, messages.heartbeat(last_seq=seq - 1 if last_seq is None else last_seq))


def kinds(actions: list[Send]) -> list[Kind]:
    return [a.kind for a in actions]


@pytest.fixture
def table() -> PeerTable:
    store = PartitionStore()
    yield PeerTable(store, stale_after=5.0)
    store.close()


def snapshot(table: PeerTable) -> dict[str, Any]:
    return table._store.snapshot()


def joined(table: PeerTable, identity: bytes = ID, now: float = 0.0) -> int:
    """READY from a standalone poller, which the buffer asks to list anew: the token its first listing answers."""
    actions = table.on_message(identity, ready(), now)
    assert kinds(actions) == [Kind.SYNC, Kind.RESYNC]  # the SYNC first: a listing answers the RESYNC, not a resend
    return int(actions[0].body.token)


def started(table: PeerTable) -> None:
    token = joined(table)
    assert table.on_message(ID, delta(1, {"p": {"a": {"v": 1}}}, full=True, reset=True, sync=token), 0.0) == []
    assert snapshot(table) == {"p": {"a": {"v": 1}}}


def test_a_contiguous_stream_is_applied_and_asks_nothing(table: PeerTable) -> None:
    started(table)
    assert table.on_message(ID, delta(2, {"p": {"b": {"v": 2}}}, deletes={"p": ["a"]}), 0.1) == []
    assert snapshot(table) == {"p": {"b": {"v": 2}}}
    assert table.resyncs_requested == 0 and table.peers[ID].contiguous


def test_a_gap_asks_for_a_resync_and_ignores_deltas_until_the_snapshot(table: PeerTable) -> None:
    started(table)
    actions = table.on_message(ID, delta(5, {"p": {"late": {}}}), 0.1)
    assert kinds(actions) == [Kind.RESYNC] and actions[0].epoch == EPOCH
    # It names the last seq received: a snapshot the poller started after it already answers.
    assert actions[0].body.after == 5
    assert table.on_message(ID, delta(6, {"p": {"later": {}}}), 0.2) == []
    assert "later" not in snapshot(table)["p"] and not table.peers[ID].contiguous
    assert table.on_message(ID, delta(7, {"p": {"z": {}}}, full=True, reset=True), 0.3) == []
    assert snapshot(table) == {"p": {"z": {}}}
    assert table.peers[ID].contiguous and table.resyncs_requested == 1


def test_a_snapshot_start_after_a_gap_is_the_resync_itself(table: PeerTable) -> None:
    started(table)
    assert table.on_message(ID, delta(9, {"p": {"new": {}}}, full=True, reset=True), 0.1) == []
    assert snapshot(table) == {"p": {"new": {}}}
    assert table.resyncs_requested == 0


def test_a_heartbeat_gap_asks_for_a_resync_and_is_acknowledged(table: PeerTable) -> None:
    started(table)
    actions = table.on_message(ID, heartbeat(4, last_seq=3), 0.1)  # seq 2 and 3 never came
    assert kinds(actions) == [Kind.RESYNC, Kind.ACK]
    assert actions[1].body == Ack(4)


def test_a_heartbeat_whose_last_seq_disagrees_asks_for_a_resync(table: PeerTable) -> None:
    started(table)
    assert kinds(table.on_message(ID, heartbeat(2, last_seq=7), 0.1)) == [Kind.RESYNC, Kind.ACK]


def test_a_heartbeat_in_sequence_is_acknowledged_alone(table: PeerTable) -> None:
    started(table)
    assert kinds(table.on_message(ID, heartbeat(2), 0.1)) == [Kind.ACK]
    assert kinds(table.on_message(ID, heartbeat(3), 0.2)) == [Kind.ACK]


def test_a_silent_peer_that_comes_back_is_resynced(table: PeerTable) -> None:
    started(table)
    table.tick(3.0)
    assert table.stale_peers(3.0) == []
    table.tick(6.0)
    assert table.peers[ID].stale and table.stale_peers(6.0) == ["p1"]
    # In sequence, yet the silence may have hidden loss: resync.
    actions = table.on_message(ID, delta(2, {"p": {"b": {}}}), 6.1)
    assert kinds(actions) == [Kind.RESYNC]
    assert "b" not in snapshot(table)["p"] and not table.peers[ID].stale


def test_an_unanswered_resync_is_asked_again(table: PeerTable) -> None:
    started(table)
    table.on_message(ID, delta(5, {}), 1.0)
    assert table.tick(1.0 + RESYNC_RETRY_S / 2) == []
    assert kinds(table.tick(1.0 + RESYNC_RETRY_S + 0.01)) == [Kind.RESYNC]
    assert table.resyncs_requested == 1  # a repeated request is not a new resync


def test_a_new_epoch_mid_stream_asks_for_a_resync(table: PeerTable) -> None:
    started(table)
    assert kinds(table.on_message(ID, delta(12, {"p": {}}, epoch=EPOCH + 1), 0.1)) == [Kind.RESYNC]


def test_a_pinned_epoch_refuses_others_and_drops_retired_ones_quietly(table: PeerTable) -> None:
    table.expect(ID, EPOCH)
    table.expect(ID, EPOCH + 1)
    assert table.on_message(ID, ready(epoch=EPOCH), 0.0) == []  # an earlier process: dropped quietly
    assert table.protocol_errors == 0
    assert table.on_message(ID, ready(epoch=999), 0.0) == []
    assert table.protocol_errors == 1 and ID not in table.peers


def test_replayed_seq_and_control_kinds_are_protocol_errors(table: PeerTable) -> None:
    started(table)
    table.on_message(ID, delta(1, {"p": {"again": {}}}), 0.1)
    table.on_message(ID, Message(Kind.ACK, EPOCH, 2, Ack(1)), 0.1)
    assert table.protocol_errors == 2 and "again" not in snapshot(table)["p"]


def test_frames_are_decoded_within_the_limits(table: PeerTable) -> None:
    table._store.limits = Limits(max_keys_per_message=2)
    frames = to_frames(delta(0, {"p": {"a": {}, "b": {}, "c": {}}}))
    assert table.on_frames(ID, frames, 0.0) == []
    assert table.protocol_errors == 1 and table.bytes_received == sum(map(len, frames))


def test_past_max_peers_the_one_silent_longest_is_forgotten(caplog: pytest.LogCaptureFixture) -> None:
    store = PartitionStore(limits=Limits(max_peers=2))
    try:
        table = PeerTable(store, pinned=frozenset({b"own"}))
        table.on_message(b"own", ready(), 0.0)
        table.on_message(b"a", ready(), 1.0)
        table.on_message(b"b", ready(), 2.0)
        forgotten = [r.getMessage() for r in caplog.records if "forgot the state of" in r.getMessage()]
        assert set(table.peers) == {b"own", b"b"} and forgotten == ["more than 2 peers: forgot the state of a "
                                                                    "(silent longest)"]
    finally:
        store.close()


def test_peer_logs_are_rate_limited_and_their_levels_clamped(caplog: pytest.LogCaptureFixture) -> None:
    store = PartitionStore()
    now = [0.0]
    try:
        table = PeerTable(store, log=LogLimiter(logging.getLogger("test"), burst=3, per=60.0, clock=lambda: now[0]))
        table.on_message(ID, ready(), 0.0)
        caplog.set_level(logging.DEBUG, logger="poller")
        for seq in range(1, 101):
            table.on_message(ID, Message(Kind.LOG, EPOCH, seq, Log(50_000, "x", "y" * 100_000)), 0.0)
        forwarded = [r for r in caplog.records if r.name == "poller"]
        assert len(forwarded) == 3
        assert {r.levelno for r in forwarded} == {logging.ERROR}
        assert max(len(r.getMessage()) for r in forwarded) < 2100
        now[0] = 60.0  # the bucket refilled: the next one says how many were dropped
        table.on_message(ID, Message(Kind.LOG, EPOCH, 101, Log(30, "x", "z")), 0.0)
        assert "97 similar records were suppressed" in caplog.records[-1].getMessage()
    finally:
        store.close()


@pytest.mark.parametrize("level, clamped", [(0, logging.DEBUG), (10, 10), (20, 20), (30, 30), (40, 40),
                                            (50, logging.ERROR), (10**9, logging.ERROR), (-5, logging.DEBUG)])
def test_clamp_level(level: int, clamped: int) -> None:
    assert clamp_level(level) == clamped


def blobs_delta(seq: int, packed: dict[str, Any], *, full: bool = False, reset: bool = False,
                end: bool = True) -> Message:
    return Message(Kind.DELTA, EPOCH, seq, Delta(seq, 1.0, full, reset, end, packed, {}, 0))


def test_packed_upserts_are_held_as_they_arrived(table: PeerTable) -> None:
    started(table)
    blob = msgpack.packb({"v": 2, "s": "ok"})
    assert table.on_message(ID, blobs_delta(2, {"p": [["b"], [blob]], "q": [["c"], [msgpack.packb({})]]}),
                            0.1) == []
    assert snapshot(table) == {"p": {"a": {"v": 1}, "b": {"v": 2, "s": "ok"}}, "q": {"c": {}}}
    assert table._store._parts["p"]["b"] is blob  # held as it arrived: a resync compares these bytes


def test_undecodable_packed_tags_break_the_view_and_ask_for_a_resync(table: PeerTable) -> None:
    started(table)
    good, bad = msgpack.packb({"v": 3}), msgpack.packb({"deep": [[[[[[[[[[1]]]]]]]]]]})
    table._store.limits = Limits(max_depth=8)
    actions = table.on_message(ID, blobs_delta(2, {"p": [["ok", "deep"], [good, bad]]}), 0.1)
    assert kinds(actions) == [Kind.RESYNC] and table.protocol_errors == 1
    assert "a" in snapshot(table)["p"] and "ok" not in snapshot(table)["p"]  # nothing of that partition changed
    assert table._store.view_gap("p") is not None  # no decision on this stream until the resync
    # Deltas are ignored until the snapshot asked for; the snapshot makes the view whole again.
    assert table.on_message(ID, blobs_delta(3, {"p": [["x"], [good]]}), 0.2) == []
    assert "x" not in snapshot(table)["p"]
    assert table.on_message(ID, blobs_delta(4, {"p": [["ok"], [good]]}, full=True, reset=True), 0.3) == []
    assert snapshot(table) == {"p": {"ok": {"v": 3}}} and table._store.view_gap("p") is None


def test_a_standalone_pollers_first_listing_applies_only_when_it_answers_the_buffers_token(table: PeerTable) -> None:
    # A listing begun before the buffer heard of the poller may predate a removal it no longer remembers.
    token = joined(table)
    assert table.on_message(ID, delta(1, {"p": {"old": {}}}, full=True, reset=True, sync=token - 1), 0.0) == []
    assert snapshot(table) == {}
    assert table.on_message(ID, delta(2, {"p": {"new": {}}}, full=True, reset=True, sync=token), 0.1) == []
    assert snapshot(table) == {"p": {"new": {}}}


def test_a_standalone_poller_silent_past_max_view_age_is_withdrawn_and_lists_anew_when_back(table: PeerTable) -> None:
    table._store.bound_age(10.0)
    started(table)
    table.tick(6.0)  # stale: the view of what only it lists is not fresh
    assert table._store.view_stale("p") is not None and snapshot(table) == {"p": {"a": {"v": 1}}}
    table.tick(11.0)  # silent past max_view_age: withdrawn
    assert snapshot(table) == {} and table._store.view_stale("p") is None
    table._store.remove("p", ["gone"])  # a removal no live stream could answer leaves nothing
    assert table._store.ledger._tombs == {}
    # Back: a new listing, answering a new token, is asked for; its deltas wait for it.
    actions = table.on_message(ID, delta(2, {"p": {"b": {}}}), 12.0)
    assert kinds(actions) == [Kind.SYNC, Kind.RESYNC]
    assert snapshot(table) == {}
    token = actions[0].body.token
    table.on_message(ID, delta(3, {"p": {"b": {}}}, full=True, reset=True, sync=token), 12.1)
    assert snapshot(table) == {"p": {"b": {}}}


def test_a_removal_is_marked_to_every_poller_and_a_poll_answering_the_mark_settles_it(table: PeerTable) -> None:
    marks: list[int] = []
    table._store.on_removed = marks.append
    started(table)
    table._store.remove("p", ["a"])
    assert len(marks) == 1
    [mark] = table.marks(marks[0], 0.2)
    assert mark.kind is Kind.SYNC and mark.body.mark is True and mark.body.token == marks[0]
    # A poll on its way that began before the removal lists a new version: in doubt, hidden.
    table.on_message(ID, delta(2, {"p": {"a": {"v": 2}}}), 0.3)
    assert "a" not in snapshot(table).get("p", {})
    # The next poll answers the mark: it began after, and lists the new version still: shown.
    table.on_message(ID, delta(3, {}, sync=marks[0]), 0.4)
    assert snapshot(table)["p"]["a"] == {"v": 2}
