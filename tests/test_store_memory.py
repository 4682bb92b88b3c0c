"""How the store holds tags: exact round trips, copies out, nothing for the GC to walk."""

from __future__ import annotations

import gc
from fractions import Fraction

import msgpack
import pytest

import buffer.store
from buffer.sampling import SamplingAccess
from buffer.steps import StepSampler
from buffer.store import PartitionStore
from poller.wire.protocol import Delta, Limits
from poller.wire.tags import unpack_many_tags
from tests.helpers.deltas import apply, apply_blobs


class _Store(PartitionStore):
    """The store as ReplayBuffer composes it: partitions plus the step policy."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = StepSampler(SamplingAccess(self))

    def sample(self, partition_id: str, **kwargs: object) -> object:
        return self.steps.sample(partition_id, **kwargs)  # type: ignore[arg-type]


def test_tags_round_trip_with_their_exact_types():
    store = _Store()
    tags = {"global_steps": 3, "status": "success", "ok": True, "r": 0.5, "none": None, "t": (1, "a"),
            "l": [1, 2], "b": b"\x00", "frac": Fraction(1, 3)}  # the last one msgpack cannot hold
    store.add("train", {"k": tags})
    assert store.snapshot("train") == {"k": tags}
    got = store.sample("train", global_steps=3).tags[0]
    assert got == tags and type(got["ok"]) is bool and type(got["t"]) is tuple and type(got["frac"]) is Fraction
    got["l"].append(3)  # a copy: the store is untouched
    assert store.snapshot("train")["k"]["l"] == [1, 2]


def test_merging_an_object_msgpack_cannot_hold_keeps_merge_semantics():
    store = _Store()
    store.add("train", {"k": {"status": "running", "global_steps": 1}})
    store.add("train", {"k": {"status": "success", "frac": Fraction(2, 3)}})
    store.add("train", {"k": {"extra": 1}})
    assert store.snapshot("train") == {"k": {"status": "success", "global_steps": 1, "frac": Fraction(2, 3),
                                             "extra": 1}}
    assert store.sample("train", global_steps=1).keys == ["k"]


def test_a_resync_of_the_same_tags_changes_nothing_and_a_listing_replaces_what_its_stream_listed():
    store = _Store()
    apply(store, "src", {"train": {"k": {"global_steps": 1, "status": "running"}}})
    apply(store, "src", {"train": {"k": {"global_steps": 1, "status": "running"}}})
    store.add("train", {"k": {"mark": 7}})
    apply(store, "src", {"train": {"k": {"global_steps": 1, "status": "success"}}})
    assert store.sample("train", global_steps=1).tags == [{"global_steps": 1, "status": "success", "mark": 7}]
    # A stream lists a key's whole tags: one it no longer lists (another tool rewrote the row) is gone from the
    # view, and the trainer's own stays.
    apply(store, "src", {"train": {"k": {"status": "success"}}})
    assert store.snapshot("train") == {"k": {"status": "success", "mark": 7}}
    assert store.sample("train", global_steps=1).keys == []


def test_after_one_full_collection_the_big_containers_are_not_tracked():
    store = _Store()
    items = {f"k{i}": {"global_steps": i % 3, "status": ("success", "running")[i % 2], "r": i / 7}
             for i in range(20_000)}
    apply(store, "src", {"train": items})
    gc.collect()
    items = store._parts["train"]
    index = store.steps.index.parts["train"]
    untracked = [items, index.arrival, index.success, store.ledger._listed["src"]["train"],
                 *index.running_by_step.values(), *index.success_by_step.values()]
    assert not any(gc.is_tracked(c) for c in untracked)
    apply(store, "src", {"train": {"k1": {"status": "running"}, "new": {"status": "success"}}})
    assert not gc.is_tracked(items)  # packed values never make it tracked again


class _Counting:
    """A policy that counts the changes it is told of."""

    def __init__(self) -> None:
        self.changes: list[tuple[str, object, object]] = []

    def on_change(self, partition_id: str, key: str, old: object, new: object) -> None:
        self.changes.append((key, old, new))


def _packed(items: dict[str, dict[str, object]]) -> tuple[list[str], list[bytes]]:
    return list(items), [msgpack.packb(tags, use_bin_type=True) for tags in items.values()]


def test_packed_tags_held_already_cost_no_decode_and_tell_no_policy(monkeypatch: pytest.MonkeyPatch):
    store = PartitionStore()
    policy = _Counting()
    store.attach(policy)
    items = {f"k{i}": {"global_steps": i, "status": "success"} for i in range(100)}
    apply_blobs(store, "src", "train", *_packed(items))
    assert len(policy.changes) == 100 and store.snapshot("train") == items
    unpacked: list[bytes] = []

    def counting_unpack(blobs: list[bytes], limits: Limits) -> list[dict]:
        unpacked.extend(blobs)
        return unpack_many_tags(blobs, limits)

    monkeypatch.setattr(buffer.store, "unpack_many_tags", counting_unpack)  # the codec, counted
    items["k7"] = {"global_steps": 7, "status": "failure"}
    store.apply("src", 1, Delta(2, 0.0, True, True, True, {"train": [*_packed(items)]}, {}, 0))
    assert unpacked == [msgpack.packb(items["k7"])]  # only the changed key was unpacked
    assert policy.changes[100:] == [("k7", {"global_steps": 7, "status": "success"}, items["k7"])]
    assert store.snapshot("train") == items


def test_packed_tags_merge_into_the_trainers_own():
    store = PartitionStore()
    store.add("train", {"k": {"global_steps": 2, "status": "running"}, "t": {"pair": (1, 2)}})
    apply_blobs(store, "src", "train", *_packed({"k": {"status": "success"}, "t": {"r": 1.5}}))
    assert store.snapshot("train") == {"k": {"global_steps": 2, "status": "success"}, "t": {"pair": (1, 2), "r": 1.5}}
    assert type(store.snapshot("train")["t"]["pair"]) is tuple  # msgpack would make it a list: kept as a dict
    # The same listing again changes nothing: the held bytes are the merge, not what arrived.
    policy = _Counting()
    store.attach(policy)
    apply_blobs(store, "src", "train", *_packed({"k": {"status": "success"}, "t": {"r": 1.5}}))
    assert store.snapshot("train")["k"] == {"global_steps": 2, "status": "success"}
    assert all(old == new for _, old, new in policy.changes[2:])


def test_a_removed_key_is_not_brought_back_by_packed_tags():
    store = PartitionStore()
    apply_blobs(store, "src", "train", *_packed({"a": {"v": 1}, "b": {"v": 2}}))
    store.remove("train", ["a"])
    apply_blobs(store, "src", "train", *_packed({"a": {"v": 1}, "b": {"v": 3}}))
    assert store.snapshot("train") == {"b": {"v": 3}}


@pytest.mark.parametrize("unhashable_steps", [False, True])
def test_a_snapshot_told_at_once_indexes_as_key_by_key(unhashable_steps: bool):
    items = {f"k{i}": {"global_steps": [i % 3] if unhashable_steps and i % 11 == 0 else i % 3,
                       "status": ("running", "success", "failure", None)[i % 4]} for i in range(200)}
    items["no-step"] = {"status": "success"}
    items["running-no-step"] = {"status": "running"}
    items["bare"] = {}
    bulk, one_by_one = _Store(), _Store()
    apply(bulk, "src", {"train": items})  # the index's on_added
    for key, tags in items.items():
        apply(one_by_one, "src", {"train": {key: tags}})  # on_change per key
    assert bulk.steps.index.parts == one_by_one.steps.index.parts
    assert bulk.steps.index._arrivals == one_by_one.steps.index._arrivals == len(items)
    assert bulk.sample("train", batch_size=40, timeout=0).keys == one_by_one.sample("train", batch_size=40, timeout=0).keys


def test_memory_is_flat_once_churned_partitions_are_cleared(db, store):
    """A partition per step, each filled, sampled, removed and cleared: nothing of it stays.

    Before, each cleared partition left its dicts behind in the store, the
    ledger and the step index (200 partitions of 5,000 keys: trainer RSS
    29 -> 199 MB). Measured with tracemalloc in this (the trainer) process,
    between the first batch of partitions and three times as many.
    """
    import tracemalloc

    from buffer import ReplayBuffer

    keys = [f"k{i}" for i in range(200)]

    def churn(rb: ReplayBuffer, step: int) -> None:
        partition = f"step-{step}"
        store.kv_batch_put(keys, partition, tags=[{"global_steps": step, "status": "success"}] * len(keys))
        rb.sync(timeout=30)
        batch = rb.sample(partition, global_steps=step, timeout=30)
        assert len(batch.keys) == len(keys)
        rb.remove(partition, batch.keys)
        store.kv_clear(batch.keys, partition)

    with ReplayBuffer(source="poller.sources.sqlite:SqliteSource", source_kwargs={"path": db},
                      poll_interval=0.02) as rb:
        tracemalloc.start()
        try:
            for step in range(20):
                churn(rb, step)
            rb.sync(timeout=30)
            gc.collect()
            after_first, _ = tracemalloc.get_traced_memory()
            for step in range(20, 80):
                churn(rb, step)
            rb.sync(timeout=30)
            gc.collect()
            after_all, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert rb.stats()["keys"] == 0
    grown = after_all - after_first
    # 60 more partitions of 200 keys: ~40 KB each before; now only what the run itself holds (logs, counters).
    assert grown < 200_000, f"{grown} bytes kept for 60 cleared partitions"
