"""How the store holds tags: exact round trips, copies out, nothing for the GC to walk."""

from __future__ import annotations

import gc
from fractions import Fraction

from buffer.partitions import PartitionStore
from buffer.seam import SamplingSeam
from buffer.steps import StepSampler
from poller.listing import commit_listing, diff_raw_listing


class _Store(PartitionStore):
    """The store as ReplayBuffer composes it: partitions plus the step policy."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = StepSampler(SamplingSeam(self))

    def sample(self, partition_id: str, **kwargs: object) -> object:
        return self.steps.sample(partition_id, **kwargs)  # type: ignore[arg-type]


def test_tags_round_trip_with_their_exact_types():
    store = _Store()
    tags = {"global_steps": 3, "status": "success", "ok": True, "r": 0.5, "none": None, "t": (1, "a"),
            "l": [1, 2], "b": b"\x00", "frac": Fraction(1, 3)}  # the last one marshal cannot hold
    store.add("train", {"k": tags})
    assert store.snapshot("train") == {"k": tags}
    got = store.sample("train", global_steps=3).tags[0]
    assert got == tags and type(got["ok"]) is bool and type(got["t"]) is tuple and type(got["frac"]) is Fraction
    got["l"].append(3)  # a copy: the store is untouched
    assert store.snapshot("train")["k"]["l"] == [1, 2]


def test_merging_an_object_marshal_cannot_hold_keeps_merge_semantics():
    store = _Store()
    store.add("train", {"k": {"status": "running", "global_steps": 1}})
    store.add("train", {"k": {"status": "success", "frac": Fraction(2, 3)}})
    store.add("train", {"k": {"extra": 1}})
    assert store.snapshot("train") == {"k": {"status": "success", "global_steps": 1, "frac": Fraction(2, 3),
                                             "extra": 1}}
    assert store.sample("train", global_steps=1).keys == ["k"]


def test_a_resync_of_the_same_tags_changes_nothing():
    store = _Store()
    store.merge_listed("src", "train", {"k": {"global_steps": 1, "status": "running"}})
    store.merge_listed("src", "train", {"k": {"global_steps": 1, "status": "running"}})
    store.merge_listed("src", "train", {"k": {"status": "success"}})
    assert store.sample("train", global_steps=1).tags == [{"global_steps": 1, "status": "success"}]


def test_after_one_full_collection_the_big_containers_are_not_tracked():
    store = _Store()
    items = {f"k{i}": {"global_steps": i % 3, "status": "success", "r": i / 7} for i in range(20_000)}
    store.merge_listed("src", "train", items)
    gc.collect()
    items = store._parts["train"]
    index = store.steps.index.parts["train"]
    untracked = [items, index.arrival, index.success, store.ledger._listed["src"]["train"]]
    assert not any(gc.is_tracked(c) for c in untracked)
    store.merge_listed("src", "train", {"k1": {"status": "running"}, "new": {"status": "success"}})
    assert not gc.is_tracked(items)  # marshalled values never make it tracked again


def test_diff_raw_listing_copies_only_what_changed_and_commits_after():
    source_tags = {"s": 1}
    sent = diff_raw_listing({}, {"train": {"a": source_tags, "b": {"s": 2}}, "old": {"x": {}}}, full=True).upserts
    held_a = sent["train"]["a"]
    raw = {"train": {"a": {"s": 1}, "b": {"s": 20}, "c": None}, "old": {}}
    diff = diff_raw_listing(sent, raw, full=False)
    assert diff.upserts == {"train": {"b": {"s": 20}, "c": {}}}
    assert diff.deletes == {"old": ["x"]}
    assert sent["train"]["b"] == {"s": 2}  # not modified before the commit
    commit_listing(sent, diff, full=False)
    assert sent == {"train": {"a": {"s": 1}, "b": {"s": 20}, "c": {}}}
    assert sent["train"]["a"] is held_a and sent["train"]["a"] is not source_tags
    full = diff_raw_listing(sent, raw, full=True)
    assert full.upserts == sent and full.deletes == {}
