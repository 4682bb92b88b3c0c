"""A poll's packed tags merged in bulk, against the same changes merged key by key.

Two real stores get the same random history: a source's polls (new keys,
changed keys, keys no longer listed), the trainer's own tags beside the
source's (some msgpack cannot hold exactly, so they stay dicts), and
removals. One store takes each poll as one DELTA (:meth:`PartitionStore.apply`,
whose changed keys are merged all at once); the other takes each key of it
as a DELTA of its own. Both must hold the same tags, and their step and
group indexes must agree.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from buffer.steps import StepIndex
from buffer.store import PartitionStore
from buffer.verl.groups import GroupIndex
from poller.wire.tags import pack_tags
from tests.helpers.deltas import apply, apply_blobs

PART = "train"
STREAM = "own"
# uid_rN are a group's trajectories; uid_p its prompt (verl's keys).
KEYS = [f"u{g}_{suffix}" for g in range(6) for suffix in ("p", "r0", "r1")]


def _source_tags(rng: random.Random, key: str) -> dict[str, Any]:
    tags: dict[str, Any] = {"reward": rng.random()}
    if key.endswith("_p"):
        tags["is_prompt"] = rng.random() < 0.9
    if rng.random() < 0.9:
        tags["status"] = rng.choice(("running", "success", "failure", "pending", "finished", None))
    if rng.random() < 0.9:
        tags["global_steps"] = [1] if rng.random() < 0.05 else rng.randint(1, 3)  # some unhashable
    if rng.random() < 0.3:
        tags["score"] = rng.randint(0, 2)  # a name the next poll may leave out
    return tags


class _Pair:
    """The store merging in bulk and the store merging key by key, each with both policies."""

    def __init__(self) -> None:
        self.bulk, self.each = PartitionStore(), PartitionStore()
        self.steps = {id(store): StepIndex() for store in (self.bulk, self.each)}
        self.groups = {id(store): GroupIndex() for store in (self.bulk, self.each)}
        for store in (self.bulk, self.each):
            store.attach(self.steps[id(store)])
            store.attach(self.groups[id(store)])

    def poll(self, items: dict[str, dict[str, Any]], unlisted: list[str]) -> None:
        apply(self.bulk, STREAM, {PART: items}, {PART: unlisted})
        for key, tags in items.items():
            apply(self.each, STREAM, {PART: {key: tags}})
        apply(self.each, STREAM, {}, {PART: unlisted})

    def both(self, method: str, *args: Any) -> None:
        for store in (self.bulk, self.each):
            getattr(store, method)(*args)

    def check(self) -> None:
        assert self.bulk.snapshot(PART) == self.each.snapshot(PART)
        bulk_steps, each_steps = self.steps[id(self.bulk)].parts, self.steps[id(self.each)].parts
        assert bulk_steps.keys() == each_steps.keys()
        for part_id in bulk_steps:
            assert vars(bulk_steps[part_id]) == vars(each_steps[part_id])
        assert _groups(self.groups[id(self.bulk)]) == _groups(self.groups[id(self.each)])


def _groups(index: GroupIndex) -> dict[str, Any]:
    """Every group index field; a bucket's and a group's members as sets (the bulk path tells new keys last)."""
    out = {}
    for part_id in index.partition_ids():
        part = index.partition(part_id)
        out[part_id] = {
            "status": part.status, "step": part.step, "invalid": part.invalid,
            "unclassified": set(part.unclassified), "filtered": part.filtered,
            "buckets": {status: {step: set(uids) for step, uids in steps.items()}
                        for status, steps in part.buckets.items()},
            "trajectories": {uid: set(keys) for uid, keys in part.trajectories.items()},
        }
    return out


@pytest.mark.parametrize("seed", range(16))
def test_bulk_merge_holds_and_tells_what_a_merge_per_key_does(seed: int) -> None:
    rng = random.Random(seed)
    pair = _Pair()
    listed: set[str] = set()
    most_held = 0
    for step in range(150):
        roll = rng.random()
        if roll < 0.6:  # a poll: some keys new or changed, maybe some no longer listed
            chosen = rng.sample(KEYS, rng.randint(1, len(KEYS)))
            unlisted = [key for key in sorted(listed - set(chosen)) if rng.random() < 0.2]  # hash-seed proof
            pair.poll({key: _source_tags(rng, key) for key in chosen}, unlisted)
            listed = (listed | set(chosen)) - set(unlisted)
        elif roll < 0.8:  # the trainer's own tag beside the source's; a tuple stays a dict
            key = rng.choice(KEYS)
            pair.both("add", PART, {key: {"mine": (1, 2) if rng.random() < 0.3 else step}})
        else:
            pair.both("remove", PART, [rng.choice(KEYS)])
        pair.check()
        most_held = max(most_held, pair.bulk.key_count())
    # Not a comparison of two empty stores: keys were held on the way (removed keys re-listed by polls that
    # never answered a removal's token stay hidden, so a history may well end with none).
    assert most_held > 0


def test_a_poll_replacing_every_tag_keeps_the_bytes_that_arrived() -> None:
    """The usual poll: each changed key's tags arrive whole, and the store holds the very bytes."""
    store = PartitionStore()
    store.attach(StepIndex())
    keys = [f"k{i}" for i in range(100)]
    first = [pack_tags({"status": "running", "global_steps": 1, "reward": 0.0}) for _ in keys]
    apply_blobs(store, STREAM, PART, keys, first)
    second = [pack_tags({"status": "success", "global_steps": 1, "reward": i / 100}) for i in range(100)]
    apply_blobs(store, STREAM, PART, keys, second)
    held = store._parts[PART]
    assert all(held[key] is blob for key, blob in zip(keys, second))


def test_a_policy_without_bulk_methods_is_told_each_changed_key() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[str, Any, Any]] = []

        def on_change(self, partition_id: str, key: str, old: Any, new: Any) -> None:
            self.calls.append((key, old, new))

    store, recorder = PartitionStore(), Recorder()
    store.attach(recorder)
    apply(store, STREAM, {PART: {"a": {"v": 1}, "b": {"v": 1}}})
    apply(store, STREAM, {PART: {"a": {"v": 2}, "b": {"v": 1}}})
    assert recorder.calls == [("a", None, {"v": 1}), ("b", None, {"v": 1}), ("a", {"v": 1}, {"v": 2})]


def test_a_policy_naming_its_indexed_tags_is_told_only_of_keys_where_one_changed() -> None:
    """The store compares what an index reads (``indexed_tags``) for a poll's held keys; a tag absent reads None."""
    class Recorder:
        indexed_tags = ("status",)

        def __init__(self) -> None:
            self.replaced: list[tuple[str, Any, Any]] = []

        def on_change(self, partition_id: str, key: str, old: Any, new: Any) -> None:
            assert old is not None and new is not None, "an addition told one by one"
            self.replaced.append((key, old.get("status"), new.get("status")))

        def on_added(self, partition_id: str, keys: list[str], tags: list[Any]) -> None:
            pass

    store, recorder = PartitionStore(), Recorder()
    store.attach(recorder)
    first = {"a": {"status": "running", "r": 0}, "b": {"status": "running", "r": 0}, "c": {"r": 0},
             "d": {"status": [1], "r": 0}}
    apply(store, STREAM, {PART: first})
    # a: a reward only; b: its status; c: no status either time (None); d: an equal list (unhashable)
    apply(store, STREAM, {PART: {"a": {"status": "running", "r": 1}, "b": {"status": "success", "r": 0},
                                 "c": {"r": 1}, "d": {"status": [1], "r": 1}}})
    assert recorder.replaced == [("b", "running", "success")]
    apply(store, STREAM, {PART: {"a": {"status": "running", "r": 2}}})
    assert len(recorder.replaced) == 1  # nothing it reads changed: not told at all


def test_a_policy_attached_to_a_store_holding_keys_is_told_each_partition_in_one_call() -> None:
    """What the store holds before a policy attaches (a ``ReplayBuffer``'s step index attaches on the first
    ``sample()``) reaches it as additions: in one ``on_added`` per partition, or key by key without one."""
    store = PartitionStore()
    apply(store, STREAM, {PART: {"a": {"status": "running"}, "b": {"status": "success"}}, "val": {"c": {"v": 1}}})
    store.add(PART, {"a": {"mine": (1, 2)}})  # a tag msgpack cannot hold exactly: this key is held as a dict

    class Bulk:
        def __init__(self) -> None:
            self.added: list[tuple[str, list[str], list[Any]]] = []

        def on_change(self, partition_id: str, key: str, old: Any, new: Any) -> None:
            raise AssertionError("told one by one")

        def on_added(self, partition_id: str, keys: list[str], tags: list[Any]) -> None:
            self.added.append((partition_id, keys, tags))

    class Each:
        def __init__(self) -> None:
            self.changes: list[tuple[str, str, Any, Any]] = []

        def on_change(self, partition_id: str, key: str, old: Any, new: Any) -> None:
            self.changes.append((partition_id, key, old, new))

    bulk, each = Bulk(), Each()
    store.attach(bulk)
    store.attach(each)
    held = [(PART, ["a", "b"], [{"status": "running", "mine": (1, 2)}, {"status": "success"}]),
            ("val", ["c"], [{"v": 1}])]
    assert sorted(bulk.added) == held
    assert sorted(each.changes) == [(pid, key, None, tags) for pid, keys, tagss in held for key, tags in zip(keys, tagss)]
    index = StepIndex()
    store.attach(index)
    assert set(index.parts[PART].arrival) == {"a"} and set(index.parts[PART].success) == {"b"}
