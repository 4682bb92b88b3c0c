"""buffer.verl against verl 0.9.1's contract, on the embedded SQLite store.

0.9.1 (the release on the package index) lets ``max_off_policy_threshold``
be ``None``, reads DAPO's ``"reward"`` metric from ``rm_scores``, and
asserts its threshold and strategy. Its own behaviour on a real
TransferQueue is compared in tests/integration/test_verl_differential.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from buffer.verl import DAPO_FILTERED_REWARD_COUNTS_KEY, ReplayBuffer, VerlConfigError
from tests.conftest import wait_until
from tests.helpers.verl import verls
from tests.test_verl import Consumer, Refiller, produce, uid, uids_of
from tests.test_verl import make as make  # noqa: F401 (a fixture, used by name)

BASE: dict[str, Any] = {"trainer_mode": "sync", "trainer_config": {}, "max_off_policy_threshold": 1,
                        "max_off_policy_strategy": "drop", "sampler_kwargs": {}}


# -- configuration errors --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"max_off_policy_threshold": 0}, "Invalid max off policy threshold: 0, must be an integer greater than 0, "
                                      "or null to disable off-policy version control"),
    ({"max_off_policy_threshold": -2}, "Invalid max off policy threshold: -2, "),
    ({"max_off_policy_threshold": 1.5}, "Invalid max off policy threshold: 1.5, "),
    ({"max_off_policy_threshold": "2"}, "Invalid max off policy threshold: 2, "),
    ({"max_off_policy_strategy": "bogus"}, "Invalid max off policy strategy: bogus, must be one of ['drop', 'wait']"),
])
def test_verls_asserted_checks_raise_an_assertion_error_and_a_value_error_in_verls_words(
        kwargs: dict[str, Any], message: str) -> None:
    args = {**BASE, **kwargs}
    # verl 0.9.1's CPU tests: pytest.raises(AssertionError).
    with pytest.raises(AssertionError) as caught:
        ReplayBuffer(**args)
    assert type(caught.value) is VerlConfigError and isinstance(caught.value, ValueError)
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("kwargs", [
    {"filter_groups_metric": "acc"},
    {"sync_refill_failed_groups": True},
    {"sampler_kwargs": {"poll_intervall": 1}},
    {"sampler_kwargs": {"sample_timeout": -1}},
    {"filter_groups_metric": "acc", "refill_fn": print, "train_batch_size": 2, "gen_batch_size": 1,
     "max_inflight_gen_batches": 0},
])
def test_every_configuration_error_is_the_one_class(kwargs: dict[str, Any]) -> None:
    with pytest.raises(VerlConfigError):
        ReplayBuffer(**{**BASE, **kwargs})


def test_max_inflight_gen_batches_is_refused_in_verls_words() -> None:
    with pytest.raises(ValueError, match="^max_inflight_gen_batches must be a positive integer$"):
        ReplayBuffer(**{**BASE, "filter_groups_metric": "acc", "refill_fn": print, "train_batch_size": 2,
                        "gen_batch_size": 1, "max_inflight_gen_batches": 0})


# -- max_off_policy_threshold=None -----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_a_null_threshold_is_accepted_and_logged_at_info_as_verl_logs_it(mode: str, strategy: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="buffer")
    rb = ReplayBuffer(**{**BASE, "trainer_mode": mode, "max_off_policy_threshold": None,
                         "max_off_policy_strategy": strategy})
    assert rb.max_off_policy_threshold is None
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "off-policy" in r.getMessage()]
    assert infos == ["[V1ReplayBuffer] off-policy version control disabled (max_off_policy_threshold is null): "
                     "no samples will be dropped or awaited for staleness"]
    rb.close()


def test_a_null_threshold_with_drop_evicts_nothing_for_staleness(make, store) -> None:
    stale = produce(store, "train", "finished", step=0)
    fresh = produce(store, "train", "finished", step=9)
    rb = make("colocate_async", threshold=None, strategy="drop", refill_fn=Refiller(store, "train", 9))
    batch, metrics = rb.sample(global_steps=9, partition_id="train", batch_size=2)
    assert uids_of(batch.keys) == {stale, fresh} and verls(metrics) == {}


def test_a_null_threshold_with_wait_does_not_wait_for_old_prompts_in_flight(make, store) -> None:
    fresh = produce(store, "train", "finished", step=9)
    produce(store, "train", "running", step=0)  # span 10: with a threshold, wait would hold on it
    rb = make("separate_async", threshold=None, strategy="wait", sample_timeout=10)
    assert rb.wait_for_sampleable(9, "train", 1) == ({fresh}, {})
    batch, metrics = rb.sample(global_steps=9, partition_id="train", batch_size=1)
    assert uids_of(batch.keys) == {fresh} and verls(metrics) == {}


# -- filter_groups_metric="reward" -----------------------------------------------------------------

def produce_scored(store: Any, pid: str, scores: list[list[float]], step: int = 0) -> str:
    """A finished group whose trajectories carry ``rm_scores`` (per-token scores) as the SQLite store keeps them."""
    key = uid()
    store.kv_put(key, pid, tag={"is_prompt": True, "status": "running", "global_steps": step})
    for session, row in enumerate(scores):
        store.kv_put(f"{key}_{session}_0", pid, fields={"rm_scores": row},
                     tag={"status": "success", "global_steps": step})
    store.kv_put(key, pid, tag={"status": "finished"})
    return key


def test_the_reward_metric_sums_each_trajectorys_rm_scores(make, store) -> None:
    # Summed, [0, 1] and [1, 0] are the same reward: no signal, filtered. [0, 1] and [0, 0] differ.
    same = produce_scored(store, "train", [[0.0, 1.0], [1.0, 0.0]])
    mixed = produce_scored(store, "train", [[0.0, 1.0], [0.0, 0.0]])
    refiller = Refiller(store, "train", step=0)
    rb = make(refill_fn=refiller, filter_groups_metric="reward", train_batch_size=1, gen_batch_size=1)
    batch, metrics = rb.sample(global_steps=0, partition_id="train", batch_size=1)
    assert uids_of(batch.keys) == {mixed} and same not in store.kv_list()["train"]
    assert verls(metrics) == {"training/filter_groups/evicted_samples": 1, DAPO_FILTERED_REWARD_COUNTS_KEY: {1.0: 1}}
    assert refiller.calls == []  # enough groups already: sync DAPO drains instead of refilling


def test_the_reward_metric_ignores_extra_fields_and_other_names_ignore_rm_scores(make, store) -> None:
    # rm_scores says "no signal", reward_extra_info says "signal": each metric reads its own field only.
    key = uid()
    store.kv_put(key, "train", tag={"is_prompt": True, "status": "finished", "global_steps": 0})
    for session, acc in enumerate([0.0, 1.0]):
        store.kv_put(f"{key}_{session}_0", "train", tag={"status": "success", "global_steps": 0},
                     fields={"rm_scores": [0.5], "extra_fields": {"reward_extra_info": {"acc": acc}}})
    on_acc = make(refill_fn=print, filter_groups_metric="acc", train_batch_size=1, gen_batch_size=1)
    assert on_acc.get_sampleable_count(0, "train") == 1
    on_reward = make(refill_fn=print, filter_groups_metric="reward", train_batch_size=1, gen_batch_size=1)
    assert on_reward.get_sampleable_count(0, "train") == 0


# -- a store whose kv_clear is all or nothing (TransferQueue 0.1.8) --------------------------------

def test_a_clear_naming_a_key_already_gone_still_clears_the_rest_on_0_1_8(db: str, store) -> None:
    failure = produce(store, "train", "failure", step=0)
    finished = produce(store, "train", "finished", step=0)
    rb = ReplayBuffer(trainer_mode="colocate_async", trainer_config={}, max_off_policy_threshold=None,
                      max_off_policy_strategy="drop",
                      sampler_kwargs={"source": "tests.helpers.sources:StrictClearSqlite",
                                      "source_kwargs": {"path": db}, "poll_interval": 30, "sample_timeout": 30})
    try:
        assert rb.get_sampleable_count(0, "train") == 1  # the poller listed the store: the view holds failure_0_0
        store.kv_clear([f"{failure}_0_0"], "train")  # someone else clears it; the next listing is 30 s away
        batch, metrics = rb.sample(global_steps=0, partition_id="train", batch_size=1)
        assert uids_of(batch.keys) == {finished} and verls(metrics) == {"training/rollout_failure/evicted_samples": 1}
        listed = store.kv_list()["train"]
        assert failure not in listed and finished not in listed  # the evicted prompt and the sampled one
    finally:
        rb.close()


def test_the_wait_strategy_holds_validation_too_as_verl_does(make, store) -> None:
    # verl 0.9.1's _has_enough_samples checks the in-flight prompts' staleness whatever the partition.
    fresh = produce(store, "val", "finished", step=5)
    stale = produce(store, "val", "running", step=0)
    rb = make("colocate_async", threshold=2, strategy="wait")
    consumer = Consumer(lambda: rb.wait_for_sampleable(5, "val", 1))
    consumer.start()
    assert wait_until(lambda: rb.stats()["decisions"] >= 1)
    time.sleep(0.3)
    assert consumer.is_alive()
    store.kv_put(stale, "val", tag={"status": "finished"})
    assert consumer.outcome() == ({fresh, stale}, {})
