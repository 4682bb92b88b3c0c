"""The wire format (poller.wire.protocol) and the poller-side listing/diff/encoding helpers."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from poller.wire.errors import PollerError, ProtocolError
from poller.wire.protocol import (
    PROTOCOL_VERSION,
    RECORDS,
    Delta,
    Kind,
    Limits,
    Message,
    decode,
    encode_body,
    encode_header,
    iter_encode_delta,
    to_record,
)
from poller.wire.tags import unpack_many_tags, unpack_tags
from tests.helpers.deltas import delta_tags, packed_sent, pieces_of, polled
from tests.helpers.messages import HEARTBEAT, to_frames


def _encoded(upserts: dict[str, dict[str, Any]], deletes: dict[str, list[str]], **options: Any) -> list[bytes]:
    """Every body the poller's encoder yields for these upserts (packed) and deletes."""
    return list(iter_encode_delta(pieces_of(upserts), deletes, **options))


def _listed(raw: Any) -> dict[str, Any]:
    """``raw`` checked, as the poller's first (full) poll sends it."""
    return polled({}, raw, full=True).upserts


# One valid body per kind, with the types the schema demands.
BODIES: dict[Kind, dict[str, Any]] = {
    Kind.READY: {"pid": 1234, "name": "poller-a", "poll_interval": 0.5, "source": "m:attr", "host": "h"},
    Kind.DELTA: {
        "poll": 3, "t": 1700000000.25, "full": True, "reset": True, "end": False,
        "packed": {"train": [["k1", "k2"], [msgpack.packb({"global_steps": 1, "status": "running"}), b"\x80"]],
                   "eval": [["ü-key"], [msgpack.packb({"nested": {"a": [1, 2.5, None, "x"]}})]]},
        "deletes": {"train": ["k0", "k-1"]}, "sync": 0,
    },
    Kind.HEARTBEAT: {**HEARTBEAT, "polls": 10, "rss": 123456, "quarantined": 1,
                     "quarantined_keys": [["train", "k9", "its tags could not be read"]]},
    Kind.ERROR: {"type": "RuntimeError", "message": "boom", "traceback": "Traceback ...", "fatal": False,
                 "count": 2},
    Kind.BYE: {"last_seq": 41, "reason": "SIGTERM"},
    Kind.LOG: {"level": 30, "name": "poller.worker", "message": "careful"},
    Kind.STOP: {"reason": "close"},
    Kind.RESYNC: {"reason": "sequence gap", "after": -1},
    Kind.SYNC: {"token": 12, "partitions": [], "mark": False},
    Kind.ACK: {"seq": 9},
    Kind.WATCH: {"partition": "train", "keys": ["p1", "p2"], "seconds": 3.0, "every": 2.0},
}


def header(version: Any = PROTOCOL_VERSION, kind: Any = int(Kind.STOP), epoch: Any = 7, seq: Any = 0) -> bytes:
    return msgpack.packb([version, kind, epoch, seq])


def body(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_every_kind_is_covered() -> None:
    assert set(BODIES) == set(Kind)


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_round_trip_of_every_kind(kind: Kind) -> None:
    message = Message(kind, epoch=2**61 + 5, seq=17, body=BODIES[kind])
    frames = to_frames(message)
    assert len(frames) == 2 and all(isinstance(f, bytes) for f in frames)
    decoded = decode(frames)
    # Decoded, the body is the kind's record; fields it does not know are left out.
    assert decoded == message._replace(body=to_record(kind, BODIES[kind]))
    assert decoded.kind is kind and isinstance(decoded.body, RECORDS[kind])
    assert decode(to_frames(decoded)) == decoded  # a record encodes as well as a map
    # memoryview frames (what the receiver hands in) decode the same.
    assert decode([memoryview(f) for f in frames]) == decoded


def test_round_trip_of_a_delta_built_from_its_parts() -> None:
    upserts = {"train": {"k": {"status": "success", "global_steps": 4}}}
    deletes = {"train": ["gone"]}
    raw, = _encoded(upserts, deletes, poll=9, started=12.5, full=False, chunk_items=10, max_frame_bytes=10**6,
                    sync=4)
    # Tags travel packed, each key's alone; the body holds the record's fields and nothing else.
    assert set(msgpack.unpackb(raw)) == set(Delta._fields)
    message = decode([encode_header(Kind.DELTA, 1, 3), raw])
    assert message.body.packed == {"train": [["k"], [msgpack.packb({"status": "success", "global_steps": 4})]]}
    assert delta_tags(message.body) == upserts
    assert message.body._replace(packed={}) == Delta(poll=9, t=12.5, full=False, reset=False, end=True, packed={},
                                                     deletes=deletes, sync=4)


@pytest.mark.parametrize("kind, field, value", [(Kind.SYNC, "token", 0), (Kind.SYNC, "token", "1"),
                                                (Kind.DELTA, "sync", -1), (Kind.DELTA, "sync", 1.5)])
def test_sync_tokens_are_positive_ints(kind: Kind, field: str, value: Any) -> None:
    with pytest.raises(ProtocolError, match=field):
        decode(to_frames(Message(kind, 5, 1, {**BODIES[kind], field: value})))


# -- decode rejects, with ProtocolError only ------------------------------------------------------

def _valid_frames(kind: Kind = Kind.DELTA) -> list[bytes]:
    return to_frames(Message(kind, 5, 1, BODIES[kind]))


@pytest.mark.parametrize("frames", [[], [b"x"], _valid_frames()[:1], _valid_frames() + [b""]],
                         ids=["zero", "one-garbage", "one-valid", "three"])
def test_wrong_frame_count(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError, match="2 frames"):
        decode(frames)


@pytest.mark.parametrize("frames", [
    [b"\xc1", body({"reason": "x"})],          # 0xc1 is never used in msgpack
    [header(), b"\xc1"],
    [b"", body({"reason": "x"})],
    [header(), b""],
    [header() + b"\x00", body({"reason": "x"})],  # trailing data
], ids=["bad-header", "bad-body", "empty-header", "empty-body", "extra-bytes"])
def test_malformed_msgpack(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError, match="malformed"):
        decode(frames)


def test_truncated_frames() -> None:
    head, full = _valid_frames()
    for cut in range(1, len(head)):
        with pytest.raises(ProtocolError):
            decode([head[:cut], full])
    for cut in range(0, len(full), 7):
        with pytest.raises(ProtocolError):
            decode([head, full[:cut]])


def test_header_shape() -> None:
    for bad in (msgpack.packb({"v": 1}), msgpack.packb([1, 16, 0]), msgpack.packb([1, 16, 0, 0, 0]),
                msgpack.packb("hello")):
        with pytest.raises(ProtocolError, match="header"):
            decode([bad, body({"reason": "x"})])


def test_wrong_version_is_named() -> None:
    with pytest.raises(ProtocolError, match="version") as info:
        decode([header(version=PROTOCOL_VERSION + 6), body({"reason": "x"})])
    assert str(PROTOCOL_VERSION + 6) in str(info.value)
    with pytest.raises(ProtocolError, match="version"):
        decode([header(version="1"), body({"reason": "x"})])


@pytest.mark.parametrize("kind", [0, 7, 15, 21, 99, -1, 2**40])
def test_unknown_kind(kind: int) -> None:
    with pytest.raises(ProtocolError, match="kind"):
        decode([header(kind=kind), body({"reason": "x"})])


def test_kind_must_be_an_integer() -> None:
    for kind in ("STOP", 16.0, True, None):
        with pytest.raises(ProtocolError):
            decode([header(kind=kind), body({"reason": "x"})])


def test_negative_or_non_integer_seq() -> None:
    for seq in (-1, -(2**40), 1.0, "3", None, True):
        with pytest.raises(ProtocolError, match="seq"):
            decode([header(seq=seq), body({"reason": "x"})])
    for epoch in ("e", 1.5, None, False):
        with pytest.raises(ProtocolError, match="epoch"):
            decode([header(epoch=epoch), body({"reason": "x"})])


@pytest.mark.parametrize("obj", [[1, 2, 3], "reason", 5, None, b"\x00"])
def test_body_not_a_map(obj: Any) -> None:
    with pytest.raises(ProtocolError, match="not a map"):
        decode([header(), body(obj)])


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_every_missing_field_is_refused(kind: Kind) -> None:
    from poller.wire.protocol import RECORDS

    record = RECORDS[kind]
    for name in record._fields:
        broken = {k: v for k, v in BODIES[kind].items() if k != name}
        with pytest.raises(ProtocolError, match=repr(name)):
            decode([header(kind=int(kind)), body(broken)])


@pytest.mark.parametrize("kind, name, value", [
    (Kind.READY, "pid", "1234"),
    (Kind.READY, "pid", True),          # bool is not an int here
    (Kind.READY, "poll_interval", "fast"),
    (Kind.READY, "name", 3),
    (Kind.DELTA, "full", 1),
    (Kind.DELTA, "poll", 1.0),
    (Kind.DELTA, "t", None),
    (Kind.HEARTBEAT, "stalled_s", False),
    (Kind.ERROR, "fatal", "yes"),
    (Kind.BYE, "last_seq", "41"),
    (Kind.LOG, "level", 30.0),
    (Kind.STOP, "reason", None),
    (Kind.RESYNC, "reason", b"bytes"),
])
def test_mistyped_field(kind: Kind, name: str, value: Any) -> None:
    broken = dict(BODIES[kind], **{name: value})
    with pytest.raises(ProtocolError, match="wrong type"):
        decode([header(kind=int(kind)), body(broken)])
    with pytest.raises(ProtocolError):
        encode_body(kind, broken)


@pytest.mark.parametrize("deletes", [{"train": "k"}, {"train": [1]}, ["k"], None], ids=lambda v: repr(v))
def test_delta_deletes_are_checked(deletes: Any) -> None:
    broken = dict(BODIES[Kind.DELTA], deletes=deletes)
    with pytest.raises(ProtocolError, match="DELTA"):
        decode([header(kind=int(Kind.DELTA)), body(broken)])
    with pytest.raises(ProtocolError, match="DELTA"):
        encode_body(Kind.DELTA, broken)


@pytest.mark.parametrize("packed", [
    {"train": [["k"], [b"\x80", b"\x80"]]},  # one blob per key
    {"train": [["k", "k"], [b"\x80", b"\x81\xa1v\x01"]]},  # each key once
    {"train": [["k"], ["not bytes"]]},
    {"train": [[1], [b"\x80"]]},
    {"train": [["k"]]},
    {"train": {"k": b"\x80"}},
    {"train": [["k"], [b"\x80"], []]},
    ["train"],
], ids=lambda v: repr(v))
def test_packed_upserts_are_checked(packed: Any) -> None:
    broken = dict(BODIES[Kind.DELTA], packed=packed)
    with pytest.raises(ProtocolError, match="DELTA field 'packed'"):
        decode([header(kind=int(Kind.DELTA)), body(broken)])


def test_packed_keys_count_against_the_keys_per_message() -> None:
    many = dict(BODIES[Kind.DELTA], upserts={}, deletes={},
                packed={"train": [[f"k{i}" for i in range(20)], [b"\x80"] * 20]})
    with pytest.raises(ProtocolError, match="partitions and keys"):
        decode([header(kind=int(Kind.DELTA)), body(many)], Limits(max_keys_per_message=10))


@pytest.mark.parametrize("blob, why", [
    (msgpack.packb([1, 2]), "not a map"),
    (msgpack.packb({1: "int name"}), "map key"),
    (msgpack.packb({b"bytes name": 1}), "not a map with str names"),
    (b"\xc1", "malformed packed tags"),
    (msgpack.packb({"s": "x" * 100}), "malformed packed tags"),  # over max_str_len below
    (msgpack.packb({"deep": [[[[[[1]]]]]]}), "deeper"),
    (msgpack.packb({"ok": 1}) + b"\x00", "malformed packed tags"),  # trailing bytes
])
def test_packed_tags_are_checked_when_unpacked(blob: bytes, why: str) -> None:
    limits = Limits(max_str_len=64, max_depth=8)
    with pytest.raises(ProtocolError, match=why):
        unpack_tags(blob, limits)
    good = msgpack.packb({"ok": [1, [2]]})
    with pytest.raises(ProtocolError, match=why):  # the same check for a whole chunk at once
        unpack_many_tags([good, blob, good], limits)
    assert unpack_many_tags([good, good], limits) == [{"ok": [1, [2]]}] * 2


def test_packed_tags_cut_across_their_keys_are_refused() -> None:
    # Joined, these read as two whole maps ({"a": 1, "b": {"c": 3}}, then {"d": 4}) and an
    # empty one: three objects for three keys, but none of them is its own key's.
    blobs = [b"\x82\xa1a\x01\xa1b", msgpack.packb({"c": 3}), msgpack.packb({"d": 4}) + b"\x80"]
    with pytest.raises(ProtocolError, match="malformed packed tags"):
        unpack_many_tags(blobs)
    with pytest.raises(ProtocolError, match="malformed packed tags"):
        unpack_many_tags([msgpack.packb({"a": 1}), b""])


def test_unpacked_tags_are_the_tags() -> None:
    tags = {"global_steps": 3, "status": "success", "l": [1, {"a": None}], "b": b"\x00", "f": 0.5}
    assert unpack_tags(msgpack.packb(tags, use_bin_type=True)) == tags


def test_non_str_map_keys_are_refused() -> None:
    broken = dict(BODIES[Kind.DELTA], upserts={"train": {"k": {1: "int key"}}})
    with pytest.raises(ProtocolError):
        decode([header(kind=int(Kind.DELTA)), body(broken)])


def test_oversized_frames() -> None:
    limits = Limits(max_frame_bytes=256)
    big = dict(BODIES[Kind.LOG], message="x" * 300)
    frames = to_frames(Message(Kind.LOG, 1, 0, big))
    assert decode(frames).body.message == "x" * 300  # fine with the default limits
    with pytest.raises(ProtocolError, match="exceeds 256"):
        decode(frames, limits)
    just_fits = to_frames(Message(Kind.LOG, 1, 0, dict(BODIES[Kind.LOG], message="")))
    assert len(just_fits[1]) <= 256
    assert decode(just_fits, limits).kind is Kind.LOG
    with pytest.raises(ProtocolError, match="header"):
        decode([header(), body({"reason": "x"})], Limits(max_header_bytes=4))


def test_string_and_item_limits() -> None:
    frames = to_frames(Message(Kind.LOG, 1, 0, dict(BODIES[Kind.LOG], message="y" * 100)))
    with pytest.raises(ProtocolError):
        decode(frames, Limits(max_str_len=50))
    many = dict(BODIES[Kind.DELTA], packed={"train": [[f"k{i}" for i in range(20)], [b"\x80"] * 20]})
    frames = to_frames(Message(Kind.DELTA, 1, 0, many))
    with pytest.raises(ProtocolError):
        decode(frames, Limits(max_items=10))


def test_invalid_utf8() -> None:
    # fixmap(1) { fixstr(2) b"\xff\xfe": nil }
    with pytest.raises(ProtocolError):
        decode([header(), b"\x81\xa2\xff\xfe\xc0"])
    # a valid "reason" key whose value is invalid UTF-8
    with pytest.raises(ProtocolError):
        decode([header(), b"\x81\xa6reason\xa2\xc3\x28"])
    # in the header
    with pytest.raises(ProtocolError):
        decode([b"\x94\x01\xa1\xff\x00\x00", body({"reason": "x"})])


def test_extension_types_are_refused() -> None:
    ext = msgpack.packb({"reason": msgpack.ExtType(5, b"abc")})
    with pytest.raises(ProtocolError):
        decode([header(), ext])


def test_fuzzed_frames_raise_only_protocol_error() -> None:
    rng = random.Random(1234)
    seeds = [to_frames(Message(kind, 3, 2, BODIES[kind])) for kind in Kind]
    accepted = refused = 0
    for _ in range(3000):
        head, raw = (bytearray(f) for f in rng.choice(seeds))
        target = head if rng.random() < 0.3 else raw
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.5 and target:
                target[rng.randrange(len(target))] = rng.randrange(256)
            elif op < 0.75 and target:
                del target[rng.randrange(len(target)):]
            else:
                target.insert(rng.randrange(len(target) + 1), rng.randrange(256))
        try:
            message = decode([bytes(head), bytes(raw)])
        except ProtocolError:
            refused += 1
        else:
            accepted += 1
            assert isinstance(message, Message) and isinstance(message.body, RECORDS[message.kind])
    assert refused > 1000  # the mutations do break things, and only ProtocolError escaped


# -- encode -----------------------------------------------------------------------------------------

def test_encode_body_of_an_unencodable_value() -> None:
    with pytest.raises(ProtocolError, match="LOG"):
        encode_body(Kind.LOG, dict(BODIES[Kind.LOG], extra=object()))
    bad_delta = dict(BODIES[Kind.DELTA], extra={"when": object()})
    with pytest.raises(ProtocolError):
        encode_body(Kind.DELTA, bad_delta)
    # Tags msgpack cannot encode never reach the encoder: the poller's diff refuses them.
    assert [r.key for r in polled({}, {"train": {"k": {"s": {1, 2}}}}, full=True).refused] == ["k"]
    with pytest.raises(ProtocolError):
        encode_body(Kind.HEARTBEAT, dict(BODIES[Kind.HEARTBEAT], rss=2**70))
    assert issubclass(ProtocolError, PollerError)


def test_encode_body_checks_the_schema() -> None:
    with pytest.raises(ProtocolError, match="'pid'"):
        encode_body(Kind.READY, {"name": "x", "poll_interval": 1.0})


# -- iter_encode_delta -------------------------------------------------------------------------------

def _decode_bodies(bodies: list[bytes], max_frame_bytes: int) -> list[dict[str, Any]]:
    limits = Limits(max_frame_bytes=max_frame_bytes)
    decoded = [decode([encode_header(Kind.DELTA, 1, i), b], limits).body for i, b in enumerate(bodies)]
    return [{**body._asdict(), "upserts": delta_tags(body, limits)} for body in decoded]


def _big_diff() -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    upserts = {
        "train": {f"train-{i:04d}": {"global_steps": i // 10, "status": "success", "pad": "p" * 40}
                  for i in range(200)},
        "eval": {f"eval-{i:03d}": {"status": "running"} for i in range(30)},
    }
    deletes = {"train": [f"old-{i}" for i in range(50)], "eval": ["e-old"]}
    return upserts, deletes


def _merge_bodies(decoded: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    upserts: dict[str, dict[str, Any]] = {}
    deletes: dict[str, list[str]] = {}
    for b in decoded:
        for partition, items in b["upserts"].items():
            for key in items:
                assert key not in upserts.get(partition, {}), "an upsert was sent twice"
            upserts.setdefault(partition, {}).update(items)
        for partition, keys in b["deletes"].items():
            deletes.setdefault(partition, []).extend(keys)
    return upserts, deletes


@pytest.mark.parametrize("full", [True, False])
def test_encode_diff_splits_by_size(full: bool) -> None:
    diff_upserts, diff_deletes = _big_diff()
    limit = 2000
    bodies = _encoded(diff_upserts, diff_deletes, poll=4, started=99.5, full=full, chunk_items=100_000, max_frame_bytes=limit)
    assert len(bodies) > 3
    assert all(len(b) <= limit for b in bodies)
    decoded = _decode_bodies(bodies, limit)
    assert [b["reset"] for b in decoded] == [full] + [False] * (len(decoded) - 1)
    assert [b["end"] for b in decoded] == [False] * (len(decoded) - 1) + [True]
    assert all(b["full"] is full and b["poll"] == 4 and b["t"] == 99.5 for b in decoded)
    upserts, deletes = _merge_bodies(decoded)
    assert upserts == diff_upserts
    assert {p: sorted(k) for p, k in deletes.items()} == {p: sorted(k) for p, k in diff_deletes.items()}


def test_encode_diff_splits_by_item_count() -> None:
    diff_upserts, diff_deletes = {"p": {f"k{i}": {"i": i} for i in range(10)}}, {"p": ["x", "y"]}
    bodies = _encoded(diff_upserts, diff_deletes, poll=1, started=0.0, full=True, chunk_items=3, max_frame_bytes=10**6)
    decoded = _decode_bodies(bodies, 10**6)
    assert len(decoded) >= 4
    assert all(sum(map(len, b["upserts"].values())) + sum(map(len, b["deletes"].values())) <= 3
               for b in decoded)
    assert decoded[0]["reset"] and not any(b["reset"] for b in decoded[1:])
    assert decoded[-1]["end"] and not any(b["end"] for b in decoded[:-1])
    upserts, deletes = _merge_bodies(decoded)
    assert upserts == diff_upserts and deletes == diff_deletes


def test_encode_diff_of_a_small_or_empty_diff_is_one_body() -> None:
    for diff_upserts in ({}, {"p": {"k": {"s": 1}}}):
        bodies = _encoded(diff_upserts, {}, poll=2, started=1.0, full=True, chunk_items=4096, max_frame_bytes=10**6)
        assert len(bodies) == 1
        (only,) = _decode_bodies(bodies, 10**6)
        assert only["reset"] and only["end"] and only["full"]
        assert only["upserts"] == diff_upserts and only["deletes"] == {}


def test_encode_diff_sends_no_empty_bodies() -> None:
    by_count = {"p": {f"k{i}": {"i": i} for i in range(10)}}
    bodies = _encoded(by_count, {}, poll=1, started=0.0, full=True, chunk_items=5, max_frame_bytes=10**6)
    assert len(bodies) == 2
    by_size = {"p": {f"k{i:03d}": {"pad": "x" * 40} for i in range(64)}}
    decoded = _decode_bodies(_encoded(by_size, {}, poll=1, started=0.0, full=True, chunk_items=4096,
                                         max_frame_bytes=1000), 1000)
    assert all(b["upserts"] or b["deletes"] for b in decoded)


def test_encode_diff_refuses_one_entry_over_the_limit() -> None:
    with pytest.raises(ProtocolError, match="frame limit"):
        _encoded({"p": {"small": {"s": 1}, "huge": {"blob": "x" * 5000}}}, {}, poll=1, started=0.0, full=True, chunk_items=4096, max_frame_bytes=1000)


def test_unencodable_tags_are_refused_before_they_are_encoded() -> None:
    got = polled({}, {"p": {"k": {"bad": object()}, "ok": {}}}, full=True)
    assert got.upserts == {"p": {"ok": {}}} and [r.key for r in got.refused] == ["k"]


# -- the diff (poller.diff) -------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    [("train", {})],
    "train",
    42,
], ids=repr)
def test_a_listing_of_garbage_is_refused(raw: Any) -> None:
    with pytest.raises(TypeError):
        _listed(raw)


@pytest.mark.parametrize("raw, refused", [
    ({1: {"k": {}}, "ok": {"a": {}}}, [(1, "k", "partition id 1 is int, not str")]),
    ({"train": {2: {}, "a": {}}}, [("train", 2, "key is int, not str")]),
    ({"train": {"k": ["not", "a", "mapping"], "a": {}}}, [("train", "k", "tags are list, not a mapping")]),
    ({"train": {"k": "running", "a": {}}}, [("train", "k", "tags are str, not a mapping")]),
    ({"bad": ["k1", "k2"], "train": {"a": {}}}, [("bad", "*", "the partition's entry is list, not a mapping of keys")]),
], ids=repr)
def test_a_bad_record_is_refused_alone_and_the_rest_is_listed(raw: Any, refused: list[Any]) -> None:
    diff = polled({}, raw, full=True)
    assert [tuple(r) for r in diff.refused] == refused
    assert [key for items in diff.upserts.values() for key in items] == ["a"]


def test_a_listing_maps_none_and_leaves_the_sources_tags_alone() -> None:
    assert _listed(None) == {}
    assert _listed({}) == {}
    source_tags = {"status": "running", "pair": (1, 2)}
    raw = {"train": {"k1": source_tags, "k2": None}, "empty": {}, "gone": None}
    assert _listed(raw) == {"train": {"k1": {"status": "running", "pair": [1, 2]}, "k2": {}}}
    assert source_tags == {"status": "running", "pair": (1, 2)}  # the screen converts a copy


def test_diff_finds_changed_new_and_vanished() -> None:
    sent = packed_sent({"train": {"a": {"s": 1}, "b": {"s": 2}, "d": {"s": 4}}, "old": {"x": {}}})
    before = {partition: dict(items) for partition, items in sent.items()}
    listing = {"train": {"a": {"s": 1}, "b": {"s": 20}, "c": {"s": 3}}, "new": {"n": {}}}
    diff = polled(sent, listing, full=False)
    assert diff.upserts == {"train": {"b": {"s": 20}, "c": {"s": 3}}, "new": {"n": {}}}
    assert {p: sorted(k) for p, k in diff.deletes.items()} == {"train": ["d"], "old": ["x"]}
    assert sent == before  # not modified before the commit
    diff.diff.commit(sent)
    assert sent == packed_sent(listing)


def test_diff_full_sends_everything_and_deletes_nothing() -> None:
    sent = packed_sent({"train": {"a": {"s": 1}, "gone": {}}})
    listing = {"train": {"a": {"s": 1}, "b": {}}}
    diff = polled(sent, listing, full=True)
    assert diff.upserts == listing and diff.deletes == {}


def test_diff_of_identical_listings_is_empty() -> None:
    diff = polled(packed_sent({"train": {"a": {"s": 1}}}), {"train": {"a": {"s": 1}}}, full=False)
    assert diff.upserts == {} and diff.deletes == {} and diff.refused == []
