"""A poll sent piece by piece (poller.pieces.ScreenedPieces): the same stream as the whole diff, made lazily."""

from __future__ import annotations

import random
from typing import Any

import pytest

from poller.deltas import iter_encode_pieces
from poller.listing import Listing, ListingDiff, RawSnapshot, commit_listing, diff_raw_listing
from poller.pieces import ScreenedPieces, screen_diff
from poller.wire.protocol import Kind, Limits, decode, encode_header
from poller.wire.tags import delta_upserts, pack_tags

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
        for partition, items in delta_upserts(delta, LIMITS).items():
            upserts.setdefault(partition, {}).update(items)
        for partition, keys in delta.deletes.items():
            deletes.setdefault(partition, []).extend(keys)
        ends.append(delta.end)
    return upserts, deletes, ends


def _send(given: ListingDiff | RawSnapshot, sent: Listing, full: bool,
          size: int) -> tuple[ScreenedPieces, list[bytes]]:
    pieces = ScreenedPieces(given, sent, full, LIMITS, size)
    bodies = list(iter_encode_pieces(pieces, pieces.deletes, poll=1, started=0.0, full=full, chunk_items=size,
                                     max_frame_bytes=LIMITS.max_frame_bytes))
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
    sent_pieces: Listing = {}
    sent_whole: Listing = {}
    held_pieces: dict[str, dict[str, Any]] = {}
    held_whole: dict[str, dict[str, Any]] = {}
    listing = _listing(rng, rng.randrange(0, 150))
    for poll in range(5):
        full = poll in (0, 2)  # a first snapshot, a poll, a resync, two polls
        whole = screen_diff(diff_raw_listing(sent_whole, listing, full), sent_whole, full, LIMITS)
        given = RawSnapshot(listing) if full else diff_raw_listing(sent_pieces, listing, full)
        pieces, bodies = _send(given, sent_pieces, full, size)
        upserts, deletes, ends = _received(bodies)
        _apply(held_pieces, upserts, deletes, full)
        _apply(held_whole, whole.upserts, whole.deletes, full)

        assert {p: items for p, items in held_pieces.items() if items} == \
            {p: items for p, items in held_whole.items() if items}
        assert sorted(map(repr, pieces.refused)) == sorted(map(repr, whole.refused))
        assert ends == [False] * (len(bodies) - 1) + [True]
        key_counts = [sum(len(keys) for keys, _ in decode([encode_header(Kind.DELTA, 1, 0), b],
                                                          LIMITS).body.packed.values()) for b in bodies]
        assert all(n <= size for n in key_counts)
        if full:  # a poll does not send again tags converted to what was sent
            assert upserts == {p: items for p, items in whole.upserts.items() if items}

        commit_listing(sent_pieces, pieces.diff, full, pieces.packed)
        commit_listing(sent_whole, whole, full)
        assert {p: set(items) for p, items in sent_pieces.items() if items} == \
            {p: set(items) for p, items in sent_whole.items() if items}
        listing = _changed(rng, listing)


def test_a_snapshot_is_diffed_and_screened_only_as_far_as_its_pieces_were_taken() -> None:
    listing = {"a": {f"k{i}": {"v": i} for i in range(8)}, "b": {"bad": {"s": "x" * 100}, "ok": {"v": 1}}}
    pieces = ScreenedPieces(RawSnapshot(listing), {}, True, LIMITS, 4)
    taken = iter(pieces)
    first = next(taken)
    assert first == {"a": {f"k{i}": first["a"][f"k{i}"] for i in range(4)}}
    assert pieces.refused == []  # partition b's bad key not looked at yet
    rest = list(taken)
    assert [sorted(p) for p in rest] == [["a"], ["b"]]
    assert [(r.partition, r.key) for r in pieces.refused] == [("b", "bad")]
    assert pieces.keys_sent()["b"] == ["ok"]


def test_a_resync_screens_only_the_tags_that_changed_since_they_were_sent() -> None:
    sent: Listing = {}
    listing: dict[str, dict[str, Any]] = {"p": {f"k{i}": {"v": i} for i in range(10)}}
    pieces, _ = _send(RawSnapshot(listing), sent, True, 4)
    commit_listing(sent, pieces.diff, True, pieces.packed)
    assert sent == {"p": {f"k{i}": pack_tags({"v": i}) for i in range(10)}}
    # A resync lists the same tags again: they are sent as they were packed,
    # not screened (an entry of sent changed behind the diff's back shows
    # it: it passes); new bad tags are refused.
    held: dict[str, Any] = sent["p"]
    held["k0"] = pack_tags({"s": "x" * 100})
    listing["p"]["k0"] = {"s": "x" * 100}
    listing["p"]["new"] = {"s": "y" * 100}
    assert RawSnapshot(listing).diff(sent).fresh == {"p": ["new"]}
    pieces = ScreenedPieces(RawSnapshot(listing), sent, True, LIMITS, 4)
    packed = [key for piece in pieces for key in piece["p"]]
    assert [(r.partition, r.key) for r in pieces.refused] == [("p", "new")]
    assert sorted(packed) == sorted(f"k{i}" for i in range(10))
