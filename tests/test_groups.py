"""The group index and verl's rules, fed changes directly (no store, no poller)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from buffer.verl.config import SamplerConfig
from buffer.verl.groups import (
    DAPO_FILTERED_REWARD_COUNTS_KEY,
    DrainState,
    GroupIndex,
    accumulate_metrics,
    classify,
    plan_async,
    plan_sync,
    sampleable_count,
    uid_of,
)
from poller.wire.vocabulary import FINISHED


class Feed:
    """Merges tags per key like the store and tells the index what changed."""

    def __init__(self) -> None:
        self.index = GroupIndex()
        self.items: dict[str, dict[str, dict[str, Any]]] = {}

    def put(self, pid: str, key: str, **tags: Any) -> None:
        part = self.items.setdefault(pid, {})
        old = part.get(key)
        new = {**(old or {}), **tags}
        part[key] = new
        self.index.on_change(pid, key, None if old is None else dict(old), dict(new))

    def clear(self, pid: str, keys: list[str]) -> None:
        for key in keys:
            old = self.items.get(pid, {}).pop(key, None)
            if old is not None:
                self.index.on_change(pid, key, old, None)

    def group(self, pid: str, uid: str, status: str, step: int = 0, sessions: int = 1) -> list[str]:
        """verl's order: trajectories first, then the prompt's status."""
        keys = [f"{uid}_{s}_0" for s in range(sessions)]
        for key in keys:
            self.put(pid, key, status="success", global_steps=step)
        self.put(pid, uid, is_prompt=True, status=status, global_steps=step)
        return keys


_NAMES = {"threshold": "max_off_policy_threshold", "strategy": "max_off_policy_strategy",
          "dapo_metric": "filter_groups_metric", "refill_failed": "sync_refill_failed_groups"}


def rules(has_refill: bool = True, **overrides: Any) -> SamplerConfig:
    """The sampler's options record as the rules read it; combinations the constructor refuses are allowed here."""
    base = SamplerConfig.resolve(asynchronous=False, trainer_mode="sync", max_off_policy_threshold=8,
                                 max_off_policy_strategy="drop", sampler_kwargs={}, refill_fn=lambda n: n,
                                 given={"train_batch_size": 2, "gen_batch_size": 1})
    fields = {_NAMES.get(name, name): value for name, value in overrides.items()}
    return dataclasses.replace(base, refill_fn=base.refill_fn if has_refill else None, **fields)


def test_uid_is_the_part_before_the_first_underscore() -> None:
    assert uid_of("abc_1_2") == "abc" and uid_of("abc") == "abc" and uid_of("a_b_c_d") == "a"


def test_status_transitions_move_a_prompt_between_buckets() -> None:
    feed = Feed()
    feed.put("train", "u1", is_prompt=True, status="pending", global_steps=3)
    part = feed.index.partition("train")
    assert part.count("pending") == 1
    feed.put("train", "u1", status="running")  # the agent loop's tag-only put, merged
    assert (part.count("pending"), part.count("running")) == (0, 1)
    feed.put("train", "u1_0_0", status="success", global_steps=3)
    feed.put("train", "u1", status="finished")
    assert list(part.uids(FINISHED)) == ["u1"] and part.trajectory_keys(["u1"]) == ["u1_0_0"]
    assert part.unclassified == {"u1": None}
    feed.clear("train", ["u1", "u1_0_0"])
    assert feed.index.partition_ids() == []  # an emptied partition is forgotten


def test_a_trajectory_tag_change_costs_nothing_and_the_index_matches_a_rebuild() -> None:
    rng = random.Random(7)
    feed = Feed()
    statuses = ["pending", "running", "finished", "failure"]
    for step in range(300):
        uid = f"u{rng.randrange(40)}"
        what = rng.random()
        if what < 0.4:
            feed.put("train", uid, is_prompt=True, status=rng.choice(statuses), global_steps=rng.randrange(5))
        elif what < 0.8:
            feed.put("train", f"{uid}_{rng.randrange(3)}_0", status="success", n=step)
        else:
            feed.clear("train", [k for k in list(feed.items.get("train", {})) if uid_of(k) == uid])
    rebuilt = GroupIndex()
    for key, tags in feed.items.get("train", {}).items():
        rebuilt.on_change("train", key, None, tags)
    mine, theirs = feed.index.partition("train"), rebuilt.partition("train")
    assert mine.status == theirs.status and mine.step == theirs.step
    for status in statuses:
        assert {s: set(u) for s, u in mine.buckets[status].items()} == \
            {s: set(u) for s, u in theirs.buckets[status].items()}
    assert {u: set(k) for u, k in mine.trajectories.items()} == {u: set(k) for u, k in theirs.trajectories.items()}
    assert set(mine.unclassified) == set(theirs.unclassified)


def test_malformed_prompts_are_held_aside_and_refused_at_decision() -> None:
    feed = Feed()
    feed.put("train", "bad", is_prompt=True, status="bogus", global_steps=0)
    feed.put("train", "nostep", is_prompt=True, status="finished")
    feed.group("other", "fine", "finished")
    plan = plan_sync(feed.index.partition("train"), rules(), "train", 0, 1, DrainState())
    assert plan is not None and isinstance(plan.error, ValueError)
    assert "unknown status 'bogus'" in str(plan.error) and "no integer global_steps" in str(plan.error)
    # Another partition decides normally.
    plan = plan_sync(feed.index.partition("other"), rules(), "other", 0, 1, DrainState())
    assert plan is not None and plan.select == ["fine"]
    feed.put("train", "bad", status="failure")  # corrected: usable again
    feed.put("train", "nostep", global_steps=1)
    assert not feed.index.partition("train").invalid


def test_selection_is_oldest_step_first_and_returns_whole_groups() -> None:
    feed = Feed()
    newest = feed.group("p", "new", "finished", step=5, sessions=2)
    oldest = feed.group("p", "old", "failure", step=1, sessions=1)
    feed.group("p", "mid", "finished", step=2)
    feed.group("p", "run", "running", step=0)
    plan = plan_sync(feed.index.partition("p"), rules(), "p", 5, 2, DrainState())
    assert plan is not None and plan.select == ["old", "mid"]
    assert plan.select_keys == [*oldest, "mid_0_0"] and newest[0] not in plan.select_keys
    # Not enough terminal groups: wait.
    assert plan_sync(feed.index.partition("p"), rules(), "p", 5, 4, DrainState()) is None


def test_async_drop_evicts_stale_finished_and_every_failure_with_verls_metrics() -> None:
    feed = Feed()
    feed.group("p", "stale", "finished", step=0)
    feed.group("p", "edge", "finished", step=4)  # span 2 = threshold: kept
    feed.group("p", "fail", "failure", step=5)
    feed.group("p", "slow", "running", step=0)  # in flight: never evicted
    plan = plan_async(feed.index.partition("p"), rules(asynchronous=True, threshold=2), "train", 5, 1, select=True)
    assert plan is not None and plan.evict == {"stale", "fail"} and plan.refill == 2
    assert set(plan.clear) == {"stale", "stale_0_0", "fail", "fail_0_0"}
    assert plan.metrics == {"training/off_policy/evicted_samples": 1,
                            "training/off_policy/evicted_samples_staleness/mean": 6.0,
                            "training/off_policy/evicted_samples_staleness/max": 6.0,
                            "training/off_policy/evicted_samples_staleness/min": 6.0,
                            "training/rollout_failure/evicted_samples": 1}
    feed.clear("p", plan.clear)
    plan = plan_async(feed.index.partition("p"), rules(asynchronous=True, threshold=2), "train", 5, 1, select=True)
    assert plan is not None and plan.ready and plan.select == ["edge"]
    # Validation never evicts.
    feed.group("val", "old", "failure", step=0)
    plan = plan_async(feed.index.partition("val"), rules(asynchronous=True, threshold=1), "val", 9, 1, select=True)
    assert plan is not None and plan.select == ["old"] and not plan.evict


def test_async_wait_holds_while_an_in_flight_prompt_reached_the_threshold() -> None:
    feed = Feed()
    feed.group("p", "done", "finished", step=5)
    feed.put("p", "late", is_prompt=True, status="pending", global_steps=4)  # span 2 >= 2
    config = rules(asynchronous=True, threshold=2, strategy="wait")
    assert plan_async(feed.index.partition("p"), config, "p", 5, 1, select=False) is None
    feed.put("p", "late", status="finished")
    plan = plan_async(feed.index.partition("p"), config, "p", 5, 1, select=False)
    assert plan is not None and plan.ready and plan.sampleable == {"done", "late"}


def test_sync_failure_refill_evicts_only_empty_failure_groups() -> None:
    feed = Feed()
    feed.group("p", "ok", "finished")
    feed.group("p", "empty", "failure", sessions=0)
    feed.group("p", "partial", "failure", sessions=1)
    plan = plan_sync(feed.index.partition("p"), rules(refill_failed=True), "p", 0, 3, DrainState())
    assert plan is not None and plan.evict == {"empty"} and plan.refill == 1
    assert plan.metrics == {"validation/rollout_failure/evicted_samples": 1}
    # Without the option failure groups are sampleable (padded downstream).
    plan = plan_sync(feed.index.partition("p"), rules(), "p", 0, 3, DrainState())
    assert plan is not None and plan.select is not None and set(plan.select) == {"ok", "empty", "partial"}


def test_sync_dapo_asks_for_metrics_then_refills_twice_and_discards_surplus() -> None:
    feed = Feed()
    feed.group("p", "same", "finished", sessions=2)
    feed.group("p", "mixed", "finished", sessions=2)
    config = rules(dapo_metric="acc")
    state = DrainState()
    part = feed.index.partition("p")
    plan = plan_sync(part, config, "p", 1, 2, state)
    assert plan is not None and plan.fetch == {"same": ["same_0_0", "same_1_0"], "mixed": ["mixed_0_0", "mixed_1_0"]}
    assert feed.index.record_metric("p", "same", ["same_0_0", "same_1_0"], classify([0.0, 0.0]))
    assert feed.index.record_metric("p", "mixed", ["mixed_0_0", "mixed_1_0"], classify([0.0, 1.0]))
    assert not feed.index.record_metric("p", "mixed", ["mixed_0_0"], None)  # already recorded: refused
    plan = plan_sync(part, config, "p", 1, 2, state)
    assert plan is not None and plan.evict == {"same"} and plan.refill == 2 and state.credit == 0
    assert plan.metrics == {"validation/filter_groups/evicted_samples": 1, DAPO_FILTERED_REWARD_COUNTS_KEY: {0.0: 1}}
    feed.clear("p", plan.clear)
    for uid in ("r1", "r2"):
        feed.group("p", uid, "finished", step=1, sessions=2)
        assert feed.index.record_metric("p", uid, [f"{uid}_0_0", f"{uid}_1_0"], None)
    plan = plan_sync(part, config, "p", 1, 2, state)
    assert plan is not None and plan.select == ["mixed", "r1"] and not plan.evict
    assert set(plan.clear) == {"r2", "r2_0_0", "r2_1_0"}  # the surplus, discarded
    assert plan.metrics == {"validation/filter_groups/discarded_surplus_samples": 1}


def test_sync_dapo_dispatches_credit_only_into_free_in_flight_slots() -> None:
    feed = Feed()
    feed.group("p", "same", "finished", sessions=2)
    feed.group("p", "slow", "running", sessions=2)
    part = feed.index.partition("p")
    assert feed.index.record_metric("p", "same", ["same_0_0", "same_1_0"], 1.0)
    state = DrainState()
    plan = plan_sync(part, rules(dapo_metric="acc"), "p", 1, 2, state)
    # 2 credits, max_inflight_gen_batches * train_batch_size = 2 slots, 1 taken by "slow".
    assert plan is not None and plan.refill == 1 and state.credit == 1


def test_a_trajectory_arriving_after_classification_makes_it_read_again() -> None:
    feed = Feed()
    feed.group("p", "g", "finished", sessions=2)
    part = feed.index.partition("p")
    assert feed.index.record_metric("p", "g", ["g_0_0", "g_1_0"], 3.0) and part.filtered == {"g": 3.0}
    feed.put("p", "g_2_0", status="success")
    assert part.filtered == {} and "g" in part.unclassified
    assert not feed.index.record_metric("p", "g", ["g_0_0", "g_1_0"], 3.0)  # read before the change: refused


def test_sampleable_count_excludes_what_would_be_evicted() -> None:
    feed = Feed()
    feed.group("p", "fresh", "finished", step=5)
    feed.group("p", "stale", "finished", step=0)
    assert sampleable_count(feed.index.partition("p"), rules(asynchronous=True, threshold=1), "p", 5) == 1
    assert sampleable_count(feed.index.partition("p"), rules(threshold=1), "p", 5) == 2  # sync: no staleness


def test_classify_and_accumulate_follow_verl() -> None:
    assert classify([1.0]) is None and classify([1.0, 1.0]) == 1.0 and classify([0.0, 1.0]) is None
    acc: dict[str, Any] = {}
    accumulate_metrics(acc, {"training/off_policy/evicted_samples": 1,
                             "training/off_policy/evicted_samples_staleness/mean": 6.0,
                             "training/off_policy/evicted_samples_staleness/max": 6.0,
                             "training/off_policy/evicted_samples_staleness/min": 6.0,
                             DAPO_FILTERED_REWARD_COUNTS_KEY: {0.0: 3}})
    accumulate_metrics(acc, {"training/off_policy/evicted_samples": 3,
                             "training/off_policy/evicted_samples_staleness/mean": 2.0,
                             "training/off_policy/evicted_samples_staleness/max": 3.0,
                             "training/off_policy/evicted_samples_staleness/min": 1.0,
                             DAPO_FILTERED_REWARD_COUNTS_KEY: {0.0: 1, 1.0: 2}})
    assert acc == {"training/off_policy/evicted_samples": 4,
                   "training/off_policy/evicted_samples_staleness/mean": pytest.approx(3.0),
                   "training/off_policy/evicted_samples_staleness/max": 6.0,
                   "training/off_policy/evicted_samples_staleness/min": 1.0,
                   DAPO_FILTERED_REWARD_COUNTS_KEY: {0.0: 4, 1.0: 2}}


def test_a_partitions_version_moves_with_what_the_rules_read_and_only_then() -> None:
    feed = Feed()
    index = feed.index
    assert index.version("train") == 0  # never had groups
    seen = {index.version("train")}

    def moved() -> bool:
        version = index.version("train")
        fresh = version not in seen
        seen.add(version)
        return fresh

    feed.put("train", "u1", is_prompt=True, status="running", global_steps=0)
    assert moved()
    feed.put("train", "u1_0_0", status="running", global_steps=0)  # a new trajectory key
    assert moved()
    feed.put("train", "u1_0_0", tokens=7)  # a trajectory's tags: no rule reads them
    feed.put("train", "u1", note="x")  # a prompt's other tags
    feed.put("val", "v1", is_prompt=True, status="running", global_steps=0)  # another partition
    assert not moved()
    feed.put("train", "u1", status="finished")
    assert moved()
    assert index.record_metric("train", "u1", ["u1_0_0"], None)  # the DAPO classification is read by the rules
    assert moved()
    assert not index.record_metric("train", "u1", ["u1_0_0"], None)  # refused: nothing changed
    assert not moved()
    feed.clear("train", ["u1", "u1_0_0"])
    # Emptied: nothing of it is kept, and it reads as a partition with no groups (an equal view).
    assert index.version("train") == 0 and index.partition_ids() == ["val"]
    feed.put("train", "u2", is_prompt=True, status="running", global_steps=1)  # the partition comes back
    assert moved()  # with a version never seen before


def test_in_flight_lists_prompts_not_yet_terminal_newest_step_first_and_stops_at_the_limit() -> None:
    index = GroupIndex()
    for key, status, step in (("a", "running", 0), ("b", "pending", 2), ("c", "running", 2), ("d", "finished", 3),
                              ("e", "running", 1), ("f", "failure", 2)):
        index.on_change("train", key, None, {"is_prompt": True, "status": status, "global_steps": step})
    part = index.partition("train")
    assert part.in_flight(10) == ["b", "c", "e", "a"]
    assert part.in_flight(2) == ["b", "c"]
    index.on_change("train", "c", {"is_prompt": True, "status": "running", "global_steps": 2},
                    {"is_prompt": True, "status": "finished", "global_steps": 2})
    assert part.in_flight(10) == ["b", "e", "a"]
