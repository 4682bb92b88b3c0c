"""A poll sent piece by piece (poller.diff.Diff): the same stream as the whole diff at once, made lazily."""

from __future__ import annotations

import random
from typing import Any

import pytest

from poller.diff import Diff, Sent
from poller.wire.protocol import Kind, Limits, decode, encode_header, iter_encode_delta
from poller.wire.tags import pack_tags
from tests.helpers.deltas import delta_tags

LIMITS = Limits(max_str_len=64, max_depth=8)


def _tags(rng: random.Random) -> Any:
    """Mostly plain tags, sometimes what the screen refuses or converts, or what is no mapping at all."""
    roll = rng.random()
    if roll < 0.05:
        return {"s": "x" * 100}  # over max_str_len: refused
    if roll < 0.08:
        return {"t": (1, 2)}  # converted to a list
    if roll < 0.10:
        return ["not", "a", "mapping"]  # refused by the diff
    if roll < 0.12:
        return None  # no tags: {}
    return {"global_steps": rng.randrange(4), "status": rng.choice(["running", "success"]), "r": rng.random()}


def _listing(rng: random.Random, keys: int) -> dict[Any, Any]:
    listing: dict[Any, Any] = {"train": {}, "val": {}}
    for i in range(keys):
        listing[rng.choice(["train", "val"])][f"k{i}" if rng.random() > 0.01 else i] = _tags(rng)
    if rng.random() < 0.3:
        listing[7] = {"k": {}}  # a partition id that is not a str
    if rng.random() < 0.3:
        listing["broken"] = 12  # a partition entry that is not a mapping
    return listing


def _changed(rng: random.Random, listing: dict[Any, Any]) -> dict[Any, Any]:
    """The next listing: some tags changed, some keys gone, some new."""
    out = {p: dict(items) if isinstance(items, dict) else items for p, items in listing.items()}
    for items in out.values():
        if not isinstance(items, dict):
            continue
        for key in list(items):
            roll = rng.random()
            if roll < 0.1:
                items[key] = _tags(rng)
            elif roll < 0.15:
                del items[key]
        for _ in range(rng.randrange(5)):
            items[f"new{rng.random()}"] = _tags(rng)
    return out


def _received(bodies: list[bytes]) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]], list[bool]]:
    upserts: dict[str, dict[str, Any]] = {}
    deletes: dict[str, list[str]] = {}
    ends = []
    for seq, body in enumerate(bodies):
        delta = decode([encode_header(Kind.DELTA, 1, seq), body], LIMITS).body
        for partition, items in delta_tags(delta, LIMITS).items():
            upserts.setdefault(partition, {}).update(items)
        for partition, keys in delta.deletes.items():
            deletes.setdefault(partition, []).extend(keys)
        ends.append(delta.end)
    return upserts, deletes, ends


def _send(listing: Any, sent: Sent, full: bool, size: int, chunk_items: int | None = None) -> tuple[Diff, list[bytes]]:
    pieces = Diff([listing], sent, full=full, limits=LIMITS, size=size)
    bodies = list(iter_encode_delta(pieces, pieces.deletes, poll=1, started=0.0, full=full,
                                    chunk_items=chunk_items or size, max_frame_bytes=LIMITS.max_frame_bytes))
    return pieces, bodies


def _apply(state: dict[str, dict[str, Any]], upserts: dict[str, dict[str, Any]],
           deletes: dict[str, list[str]], full: bool) -> None:
    """What a receiver holds after one poll (a full one replaces everything)."""
    if full:
        state.clear()
    for partition, items in upserts.items():
        state.setdefault(partition, {}).update(items)
    for partition, keys in deletes.items():
        for key in keys:
            state.get(partition, {}).pop(key, None)


@pytest.mark.parametrize("seed", range(24))
def test_a_poll_sent_in_pieces_leaves_the_receiver_what_the_whole_diff_leaves(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice([1, 3, 7, 64])
    sent_pieces: Sent = {}
    sent_whole: Sent = {}
    held_pieces: dict[str, dict[str, Any]] = {}
    held_whole: dict[str, dict[str, Any]] = {}
    listing = _listing(rng, rng.randrange(0, 150))
    for poll in range(5):
        full = poll in (0, 2)  # a first snapshot, a poll, a resync, two polls
        whole, whole_bodies = _send(listing, sent_whole, full, 10**6, chunk_items=10**6)
        whole_upserts, whole_deletes, _ = _received(whole_bodies)
        pieces, bodies = _send(listing, sent_pieces, full, size)
        upserts, deletes, ends = _received(bodies)
        _apply(held_pieces, upserts, deletes, full)
        _apply(held_whole, whole_upserts, whole_deletes, full)

        assert {p: items for p, items in held_pieces.items() if items} == \
            {p: items for p, items in held_whole.items() if items}
        assert sorted(map(repr, pieces.refused)) == sorted(map(repr, whole.refused))
        assert ends == [False] * (len(bodies) - 1) + [True]
        key_counts = [sum(len(keys) for keys, _ in decode([encode_header(Kind.DELTA, 1, 0), b],
                                                          LIMITS).body.packed.values()) for b in bodies]
        assert all(n <= size for n in key_counts)
        if full:  # a poll does not send again tags converted to what was sent
            assert upserts == {p: items for p, items in whole_upserts.items() if items}

        pieces.commit(sent_pieces)
        whole.commit(sent_whole)
        assert {p: set(items) for p, items in sent_pieces.items() if items} == \
            {p: set(items) for p, items in sent_whole.items() if items}
        listing = _changed(rng, listing)


def test_a_snapshot_is_diffed_and_screened_only_as_far_as_its_pieces_were_taken() -> None:
    listing = {"a": {f"k{i}": {"v": i} for i in range(8)}, "b": {"bad": {"s": "x" * 100}, "ok": {"v": 1}}}
    pieces = Diff([listing], {}, full=True, limits=LIMITS, size=4)
    taken = iter(pieces)
    first = next(taken)
    assert first == {"a": ([f"k{i}" for i in range(4)], [pack_tags({"v": i}) for i in range(4)])}
    assert pieces.refused == []  # partition b's bad key not looked at yet
    rest = list(taken)
    assert [sorted(p) for p in rest] == [["a"], ["b"]]
    assert [(r.partition, r.key) for r in pieces.refused] == [("b", "bad")]
    assert pieces.packed["b"][0] == ["ok"]


def test_a_resync_screens_only_the_tags_that_changed_since_they_were_sent() -> None:
    sent: Sent = {}
    listing: dict[str, dict[str, Any]] = {"p": {f"k{i}": {"v": i} for i in range(10)}}
    pieces, _ = _send(listing, sent, True, 4)
    pieces.commit(sent)
    assert sent == {"p": {f"k{i}": pack_tags({"v": i}) for i in range(10)}}
    # A resync lists the same tags again: they are sent as they were packed,
    # not screened (an entry of sent changed behind the diff's back shows
    # it: it passes); new bad tags are refused.
    held: dict[str, Any] = sent["p"]
    held["k0"] = pack_tags({"s": "x" * 100})
    listing["p"]["k0"] = {"s": "x" * 100}
    listing["p"]["new"] = {"s": "y" * 100}
    pieces = Diff([listing], sent, full=True, limits=LIMITS, size=4)
    packed = [key for piece in pieces for key in piece["p"][0]]
    assert [(r.partition, r.key) for r in pieces.refused] == [("p", "new")]
    assert sorted(packed) == sorted(f"k{i}" for i in range(10))
