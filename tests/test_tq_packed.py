"""A TransferQueue listing read packed (``kv_list_packed()``) lists what ``kv_list()`` lists, and the
poller's diff of packed tags is the diff of the decoded ones, decoding only keys whose bytes changed.

Replies are the real controller's (tests/data, see tests/test_transferqueue_source.py) and ones
built here; the diffs are compared on random listing histories.
"""

from __future__ import annotations

import pickle
import random
import struct

import msgpack
import pytest

from poller.diff import Diff
from poller.sources.contract import PackedItems, capabilities
from poller.sources.transferqueue import KV_LIST, TransferQueueReplyError, decode_listing_reply, decode_reply
from poller.wire.protocol import DEFAULT_LIMITS
from poller.wire.tags import pack_tags
from tests.helpers.deltas import polled
from tests.test_transferqueue_source import GOOD, REPLIES, _reply, typed


def _decoded(packed: PackedItems) -> dict:
    """``{key: tags}`` of one packed partition, every key decoded."""
    return dict(zip(packed.items, packed.decode(list(packed.items.values()))))


def _unpacked(body: dict) -> dict:
    """``body`` with every :class:`PackedItems` decoded, as ``kv_list()`` would have listed it."""
    partitions = body["partition_info"]
    return {**body, "partition_info": {p: _decoded(items) if type(items) is PackedItems else items
                                       for p, items in partitions.items()}}


REAL = [(name, frames) for name, frames in REPLIES["cases"].items()] + [("all_at_once", REPLIES["all_at_once"])]


@pytest.mark.parametrize("name, frames", REAL, ids=[name for name, _ in REAL])
def test_a_real_reply_read_packed_lists_what_it_lists_decoded(name, frames):
    assert typed(_unpacked(decode_listing_reply(frames))) == typed(decode_reply(KV_LIST, frames))


def test_the_real_controllers_plain_tags_are_the_bytes_the_poller_sends():
    # What makes the fast path pay: a key with plain tags compares equal without a decode.
    frames = REPLIES["cases"]["np_int64"]
    partitions = decode_listing_reply(frames)["partition_info"]
    packed = partitions["p"]
    assert type(packed) is PackedItems
    (good,) = [key for key, tags in _decoded(packed).items() if tags == GOOD]
    assert packed.items[good] == pack_tags(GOOD)
    # A numpy scalar travels as an extension type: other bytes, read by decoding.
    others = [key for key in packed.items if key != good]
    assert others and all(packed.items[key] != pack_tags(tags) for key, tags in
                          zip(others, packed.decode([packed.items[key] for key in others])))


def _ext(code: int, meta: object) -> msgpack.ExtType:
    return msgpack.ExtType(code, pickle.dumps(meta))


def _with(tags: object, extra_frames: list[bytes] | None = None, **body: object) -> list[bytes]:
    return _reply("KV_LIST_RESPONSE", {"partition_info": {"p": {"bad": tags, "good": GOOD}}, "message": "ok",
                                       **body}) + (extra_frames or [])


@pytest.mark.parametrize("frames", [
    _with({"x": _ext(3, ("int32", (2,), 1)), "n": 1}, [struct.pack("=2i", -1, 7)]),
    _with({"x": msgpack.ExtType(1, b"not a pickle")}),
    _with({"x": msgpack.ExtType(9, b"...")}),
    _with(None),
    _with([1, 2]),
    _with({"nested": {"a": [1, 2.5, "x", None, True, b"\x00"]}}),
    _with({7: "an int tag name"}),
    _reply("KV_LIST_RESPONSE", {"partition_info": {"p": {}, "q": {"k": GOOD}}, "message": "ok"}),
    _reply("KV_LIST_RESPONSE", {"partition_info": {}, "message": "ok"}),
    _reply("KV_LIST_RESPONSE", {"partition_info": {"p": {"a": GOOD, "a2": GOOD}}}),
], ids=["tensor", "bad-pickle", "unknown-ext", "none-tags", "list-tags", "nested", "int-tag-name",
        "two-partitions", "no-partitions", "no-message"])
def test_a_built_reply_read_packed_lists_what_it_lists_decoded(frames):
    body = decode_listing_reply(frames)
    assert all(type(items) is PackedItems for items in body["partition_info"].values())
    assert typed(_unpacked(body)) == typed(decode_reply(KV_LIST, frames))


@pytest.mark.parametrize("frames", [
    _reply("KV_LIST_RESPONSE", {"partition_info": {3: {"k": GOOD}}, "message": "ok"}),  # an int partition id
    _reply("KV_LIST_RESPONSE", {"partition_info": {"p": {5: GOOD}}, "message": "ok"}),  # an int key
    _reply("KV_LIST_RESPONSE", {"partition_info": {"p": {"k": GOOD}}, "message": _ext(5, ("int8", (1,), 1))})
    + [b"\x01"],  # an extension value outside the tags
    _reply("KV_LIST_RESPONSE", {"partition_info": {"p": None}, "message": "ok"}),  # a partition that is no map
], ids=["int-partition", "int-key", "ext-outside-tags", "partition-not-a-map"])
def test_a_reply_of_another_shape_is_read_decoded(frames):
    body = decode_listing_reply(frames)
    assert not any(type(items) is PackedItems for items in (body.get("partition_info") or {}).values())
    assert typed(body) == typed(decode_reply(KV_LIST, frames))


@pytest.mark.parametrize("frames", [
    [b"\xc1"],  # not msgpack
    [_reply("KV_LIST_RESPONSE", {"partition_info": {"p": {"k": GOOD}}})[0][:-3]],  # cut short
    [_reply("KV_LIST_RESPONSE", {"partition_info": {"p": {"k": GOOD}}})[0] + b"\x00"],  # a byte too many
    _reply("REQUEST_ERROR", {"message": "no such partition"}),
    _reply("LIST_PARTITIONS_RESPONSE", {"partition_ids": ["p"]}),
    [msgpack.packb([1, 2])],
    [b""],
    [],
], ids=["garbage", "truncated", "trailing", "refused", "other-reply", "not-a-map", "empty-frame", "no-frames"])
def test_a_bad_reply_read_packed_fails_as_it_fails_decoded(frames):
    with pytest.raises(TransferQueueReplyError) as decoded:
        decode_reply(KV_LIST, frames)
    with pytest.raises(TransferQueueReplyError) as packed:
        decode_listing_reply(frames)
    assert str(packed.value) == str(decoded.value)


def test_a_tag_that_does_not_decode_fails_the_listing_as_a_malformed_reply():
    # An array as a map key inside the tags: skipped whole by the walk, it fails when decoded.
    frame = _reply("KV_LIST_RESPONSE", {"partition_info": {"p": {"k": GOOD}}})[0]
    bad = frame.replace(pack_tags(GOOD), b"\x81\x91\x01\x02")
    with pytest.raises(TransferQueueReplyError, match="malformed"):
        decode_reply(KV_LIST, [bad])
    items = decode_listing_reply([bad])["partition_info"]["p"]
    with pytest.raises(TransferQueueReplyError, match="malformed"):
        items.decode(list(items.items.values()))


# -- the poller's diff of packed tags ---------------------------------------------------------------

class _Counting:
    """A ``decode`` for :class:`PackedItems` that counts the blobs it was asked to read."""

    def __init__(self) -> None:
        self.blobs = 0

    def __call__(self, blobs: list[bytes]) -> list[object]:
        self.blobs += len(blobs)
        return [msgpack.unpackb(blob, raw=False, strict_map_key=False) for blob in blobs]


def _tags(rng: random.Random) -> object:
    roll = rng.random()
    if roll < 0.03:
        return None  # listed as {}
    if roll < 0.05:
        return [1, 2]  # not a mapping: refused
    return {"global_steps": rng.randrange(3), "status": rng.choice(["running", "success"]),
            "reward": rng.choice([0.0, 0.5, 1.0])}


def _blob(tags: object, rng: random.Random) -> bytes:
    # Now and then packed by another encoder: single floats, other bytes for the same tags.
    return msgpack.packb(tags, use_bin_type=True, use_single_float=rng.random() < 0.1)


def _sent(listing: dict, sent: dict, full: bool, size: int) -> tuple[list, Diff]:
    """The pieces a poll of ``listing`` sends against ``sent``, and its diff."""
    diff = Diff([listing], sent, full=full, limits=DEFAULT_LIMITS, size=size)
    return [{p: dict(zip(*entry)) for p, entry in piece.items()} for piece in diff], diff


@pytest.mark.parametrize("seed", range(8))
def test_a_diff_of_packed_tags_is_the_diff_of_decoded_tags_and_decodes_only_what_changed(seed):
    rng = random.Random(seed)
    store: dict[str, dict[str, object]] = {p: {} for p in ("p", "q")}
    blobs: dict[str, dict[str, bytes]] = {p: {} for p in store}
    sent_plain: dict = {}
    sent_packed: dict = {}
    for poll in range(30):
        for partition in store:
            for _ in range(rng.randrange(12)):
                key = f"k{rng.randrange(60)}"
                if rng.random() < 0.2:
                    store[partition].pop(key, None)
                    blobs[partition].pop(key, None)
                else:
                    tags = _tags(rng)
                    store[partition][key] = tags
                    blobs[partition][key] = _blob(tags, rng)
        decode = _Counting()
        packed = {p: PackedItems(dict(items), decode) for p, items in blobs.items() if rng.random() < 0.9}
        plain = {p: dict(store[p]) for p in packed}
        full = poll == 0 or rng.random() < 0.1
        size = 7 if rng.random() < 0.5 else 4096  # sent in pieces, or at once
        # Only keys whose bytes are not those sent are decoded.
        differing = sum(1 for p, items in packed.items() for key, blob in items.items.items()
                        if sent_packed.get(p, {}).get(key) != blob)
        expected, expected_diff = _sent(plain, sent_plain, full, size)
        got, got_diff = _sent(packed, sent_packed, full, size)
        assert got == expected  # the same keys and the same bytes, piece by piece
        assert (got_diff.deletes, sorted(map(repr, got_diff.refused))) == \
            (expected_diff.deletes, sorted(map(repr, expected_diff.refused)))
        assert decode.blobs == differing
        expected_diff.commit(sent_plain)
        got_diff.commit(sent_packed)
        assert sent_packed == sent_plain


def test_unchanged_packed_tags_are_not_decoded_at_all():
    decode = _Counting()
    sent: dict = {}
    items = {f"k{n}": pack_tags({"status": "success", "n": n}) for n in range(100)}
    polled(sent, {"p": PackedItems(dict(items), decode)}, full=False).diff.commit(sent)
    assert decode.blobs == 100
    items["k7"] = pack_tags({"status": "success", "n": -7})
    again = polled(sent, {"p": PackedItems(dict(items), decode)}, full=False)
    assert again.upserts == {"p": {"k7": {"status": "success", "n": -7}}} and decode.blobs == 101


# -- which listing the poller takes ------------------------------------------------------------------

class _Packs:
    def kv_list(self) -> dict:
        return {}

    def kv_list_packed(self) -> dict:
        return {}


class _Logs(_Packs):
    def kv_list(self) -> dict:  # a subclass that wraps kv_list() alone: the poller must call it
        return super().kv_list()


class _LogsBoth(_Logs):
    def kv_list_packed(self) -> dict:
        return super().kv_list_packed()


class _Plain:
    def kv_list(self) -> dict:
        return {}


def test_a_source_is_listed_packed_unless_a_subclass_overrides_kv_list_alone():
    source = _Packs()
    assert capabilities(source).kv_list_packed == source.kv_list_packed
    assert capabilities(_Logs()).kv_list_packed is None
    both = _LogsBoth()
    assert capabilities(both).kv_list_packed == both.kv_list_packed
    assert capabilities(_Plain()).kv_list_packed is None
    patched = _Packs()
    patched.kv_list = lambda: {"p": {}}  # type: ignore[method-assign]
    assert capabilities(patched).kv_list_packed is None
