"""buffer.verl on the embedded SQLite store: verl's rules, waits, timeouts and lifecycle.

Writers go the way verl's trainer and agent loop do: the trainer registers a
prompt as pending, the agent loop marks it running, writes the trajectories
and then the prompt's terminal status; refill_fn writes synchronously.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
from typing import Any, Callable

import pytest

from buffer import BufferClosed
from buffer.verl import DAPO_FILTERED_REWARD_COUNTS_KEY, ReplayBuffer, ReplayBufferAsync, VerlBatch
from poller.sources.sqlite import SqliteSource
from tests.conftest import alive, wait_until
from tests.helpers.verl import verls

SPEC = "poller.sources.sqlite:SqliteSource"


def uid() -> str:
    return uuid.uuid4().hex


def produce(store: SqliteSource, pid: str, status: str, *, sessions: int = 1, step: int = 0,
            rewards: list[float] | None = None, key: str | None = None) -> str:
    """A group the agent loop's way: pending, running, trajectories, then the terminal status."""
    key = key or uid()
    store.kv_put(key, pid, tag={"is_prompt": True, "status": "pending", "global_steps": step})
    store.kv_put(key, pid, tag={"status": "running"})
    for s in range(sessions):
        fields = None if rewards is None else {"extra_fields": {"reward_extra_info": {"acc": rewards[s]}}}
        store.kv_put(f"{key}_{s}_0", pid, fields=fields, tag={"status": "success", "global_steps": step, "seq_len": 3})
    store.kv_put(key, pid, tag={"status": status})
    return key


def uids_of(keys: list[str]) -> set[str]:
    return {key.split("_")[0] for key in keys}


class Refiller:
    """refill_fn: writes fresh terminal groups synchronously, as verl's _add_prompts_to_generate submits."""

    def __init__(self, store: SqliteSource, pid: str, step: int, sessions: int = 1,
                 rewards: list[float] | None = None, before: Callable[[int], None] | None = None) -> None:
        self.store, self.pid, self.step, self.sessions, self.rewards = store, pid, step, sessions, rewards
        self.before = before
        self.calls: list[int] = []
        self.produced: list[str] = []

    def __call__(self, n: int) -> int:
        if self.before is not None:
            self.before(len(self.calls))
        self.calls.append(n)
        for _ in range(n):
            self.produced.append(produce(self.store, self.pid, "finished", sessions=self.sessions, step=self.step,
                                         rewards=self.rewards))
        return n


@pytest.fixture
def make(db: str) -> Any:
    made: list[ReplayBuffer] = []

    def build(mode: str = "sync", *, threshold: int = 8, strategy: str = "drop", refill_fn: Any = None,
              **sampler_kwargs: Any) -> ReplayBuffer:
        kwargs = {"source": SPEC, "source_kwargs": {"path": db}, "poll_interval": 0.05, "sample_timeout": 60}
        kwargs.update(sampler_kwargs)
        rb = ReplayBuffer(trainer_mode=mode, trainer_config={}, max_off_policy_threshold=threshold,
                          max_off_policy_strategy=strategy, sampler_kwargs=kwargs, refill_fn=refill_fn)
        made.append(rb)
        return rb

    yield build
    for rb in made:
        rb.close()


class Consumer(threading.Thread):
    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.call, self.result, self.error = call, None, None

    def run(self) -> None:
        try:
            self.result = self.call()
        except BaseException as exc:  # handed to the test
            self.error = exc

    def outcome(self, timeout: float = 30.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "the call did not return"
        if self.error is not None:
            raise self.error
        return self.result


# -- construction ----------------------------------------------------------------------------------

def test_dispatch_on_trainer_mode_and_verls_full_signature(db: str) -> None:
    sampler_kwargs = {"source": SPEC, "source_kwargs": {"path": db}}
    sync = ReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=2,
                        max_off_policy_strategy="drop", sampler_kwargs=sampler_kwargs)
    other = ReplayBuffer(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=2,
                         max_off_policy_strategy="wait", sampler_kwargs=sampler_kwargs, refill_fn=lambda n: n)
    # Positional, with verl's built-in keywords (train_batch_size, ...).
    full = ReplayBuffer("sync", {}, 4, "drop", sampler_kwargs, 0.5, lambda n: n, "acc", 8, 1, 2, True)
    assert type(sync) is ReplayBuffer and type(other) is ReplayBufferAsync and type(full) is ReplayBuffer
    assert not hasattr(sync, "wait_for_sampleable") and hasattr(other, "get_sampleable_count")
    assert (full.poll_interval, full.filter_groups_metric, full.max_inflight_gen_batches) == (0.5, "acc", 2)
    # The default, neither given: verl's own sampler's, which verl's hybrid switch reads to judge a step idle.
    assert sync.poll_interval == 2.0
    on_tq = ReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=2,
                         max_off_policy_strategy="drop", sampler_kwargs={})
    assert on_tq.close().stage == "no-poller"
    # No I/O: nothing started (the no_leaks fixture also sees no process or thread).
    assert sync.stats()["started"] is False and "not started" in repr(sync)
    for rb in (sync, other, full):
        assert rb.close().stage == "no-poller"
    with pytest.raises(BufferClosed):
        sync.get_sampleable_count(0, "train")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_off_policy_threshold": 0}, ValueError, "max off policy threshold"),
    ({"max_off_policy_threshold": True}, ValueError, "max off policy threshold"),
    ({"max_off_policy_strategy": "bogus"}, ValueError, "max off policy strategy"),
    ({"filter_groups_metric": "acc"}, ValueError, "requires refill_fn"),
    ({"sync_refill_failed_groups": True}, ValueError, "requires refill_fn"),
    ({"sync_refill_failed_groups": True, "refill_fn": print, "gen_batch_size": 2}, ValueError,
     "requires gen_batch_size=1"),
    ({"filter_groups_metric": "acc", "refill_fn": print, "train_batch_size": 2, "gen_batch_size": 1,
      "max_inflight_gen_batches": 0}, ValueError, "max_inflight_gen_batches"),
    ({"filter_groups_metric": "acc", "refill_fn": print}, ValueError, "needs train_batch_size"),
    ({"sampler_kwargs": {"poll_intervall": 1}}, ValueError, "unknown sampler_kwargs"),
    ({"sampler_kwargs": {"sample_timeout": -1}}, ValueError, "sample_timeout"),
    ({"sampler_kwargs": {"wait_poll_interval": 0.1}}, ValueError, "unknown sampler_kwargs"),
    ({"sampler_kwargs": {"poll_interval": 0.5}, "poll_interval": 1.0}, ValueError, "given twice"),
    ({"sampler_kwargs": ["x"]}, TypeError, "mapping"),
    ({"refill_fn": 3}, TypeError, "callable"),
    ({"trainer_mode": ""}, ValueError, "trainer_mode"),
])
def test_bad_configuration_is_refused_clearly(kwargs: dict[str, Any], error: type, match: str) -> None:
    args: dict[str, Any] = {"trainer_mode": "sync", "trainer_config": {}, "max_off_policy_threshold": 1,
                            "max_off_policy_strategy": "drop", "sampler_kwargs": {}}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ReplayBuffer(**args)


def test_options_from_sampler_kwargs_as_verls_custom_path_passes_them(db: str) -> None:
    rb = ReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=1,
                      max_off_policy_strategy="drop", refill_fn=print,
                      sampler_kwargs={"filter_groups_metric": "acc", "train_batch_size": 4, "gen_batch_size": 1,
                                      "max_inflight_gen_batches": 3, "poll_interval": 0.05})
    assert (rb.filter_groups_metric, rb.train_batch_size, rb.max_inflight_gen_batches, rb.poll_interval) == \
        ("acc", 4, 3, 0.05)


def test_sampler_kwargs_as_the_omegaconf_mapping_verl_passes(db: str, store) -> None:
    import omegaconf  # the dev extra: verl's sampler_kwargs are a DictConfig
    finished = produce(store, "train", "finished")
    config = omegaconf.OmegaConf.create({"sampler_kwargs": {"source": SPEC, "source_kwargs": {"path": db},
                                                            "poll_interval": 0.05, "sample_timeout": 60}})
    with ReplayBuffer(trainer_mode="sync", trainer_config=omegaconf.OmegaConf.create({}), max_off_policy_threshold=1,
                      max_off_policy_strategy="drop", sampler_kwargs=config.sampler_kwargs) as rb:
        batch, _ = rb.sample(global_steps=0, partition_id="train", batch_size=1)
        assert uids_of(batch.keys) == {finished} and rb.poll_interval == 0.05


# -- sync rules ------------------------------------------------------------------------------------

def test_sample_returns_whole_terminal_groups_oldest_first_and_clears_their_prompts(make, store) -> None:
    newest = produce(store, "train", "finished", sessions=2, step=5)
    oldest = produce(store, "train", "failure", sessions=1, step=1)
    middle = produce(store, "train", "finished", sessions=3, step=2)
    running = produce(store, "train", "running", step=0)
    rb = make()
    batch, metrics = rb.sample(global_steps=5, partition_id="train", batch_size=2)
    assert isinstance(batch, VerlBatch) and batch.partition_id == "train" and verls(metrics) == {}
    assert uids_of(batch.keys) == {oldest, middle} and len(batch.keys) == 4
    assert batch.tags == [{"status": "success", "global_steps": s, "seq_len": 3} for s in (1, 2, 2, 2)]
    listed = store.kv_list()["train"]
    assert oldest not in listed and middle not in listed  # the chosen prompts, cleared
    assert newest in listed and running in listed and set(batch.keys) <= set(listed)  # trajectories stay
    # Read-your-writes: at once, the next sample cannot hand the same groups out again.
    batch, _ = rb.sample(global_steps=5, partition_id="train", batch_size=1)
    assert uids_of(batch.keys) == {newest}
    # The first call decided on its poller's first listing; the second listed as it began, as verl's sampler does.
    assert rb.stats()["syncs"] == 1


def test_sample_waits_on_the_change_that_completes_it(make, store) -> None:
    produce(store, "train", "finished")
    late = produce(store, "train", "running", key=uid())
    rb = make()
    consumer = Consumer(lambda: rb.sample(global_steps=0, partition_id="train", batch_size=2))
    consumer.start()
    assert wait_until(lambda: rb.stats()["decisions"] >= 1)
    time.sleep(0.3)
    assert consumer.is_alive()
    store.kv_put(late, "train", tag={"status": "finished"})
    batch, _ = consumer.outcome()
    assert late in uids_of(batch.keys) and len(batch.keys) == 2


def test_a_waiting_sample_has_the_poller_list_every_poll_interval(make, store) -> None:
    # The poller lists nothing on its own; while sample() waits, the sampler asks for a listing every
    # poll_interval (verl's own sampler's rate: it lists, sleeps poll_interval, lists).
    produce(store, "train", "finished")
    late = produce(store, "train", "running")
    rb = make(poll_interval=0.05, sample_timeout=20)
    assert rb.get_sampleable_count(global_steps=0, partition_id="train") == 1
    consumer = Consumer(lambda: rb.sample(global_steps=0, partition_id="train", batch_size=2))
    consumer.start()
    assert wait_until(lambda: rb.stats()["wait_polls"] >= 2, timeout=10)  # polling while it waits
    store.kv_put(late, "train", tag={"status": "finished"})
    batch, _ = consumer.outcome(timeout=20)
    assert late in uids_of(batch.keys)
    time.sleep(0.3)  # a listing asked for just before it returned may still land
    polls = rb.stats()["wait_polls"]
    time.sleep(0.5)
    assert rb.stats()["wait_polls"] == polls  # and stops once it returned


def test_the_store_is_listed_at_the_start_of_every_call_and_never_between_calls(make, store) -> None:
    # As verl's own sampler: a call decides on a listing that began after it started, asked for at once (it
    # never waits for a listing paced after the one before), and nothing lists the store while the trainer trains.
    produce(store, "train", "finished")
    produce(store, "train", "finished")
    rb = make("colocate_async", threshold=None)
    assert rb.get_sampleable_count(global_steps=0, partition_id="train") == 2  # the first listing: its poller's
    polls = rb.stats()["polls"]
    time.sleep(1.0)
    assert rb.stats()["polls"] == polls  # no listing between calls
    produce(store, "train", "finished")  # written between calls
    assert rb.get_sampleable_count(global_steps=0, partition_id="train") == 3  # listed as the call began
    assert rb.stats()["polls"] == polls + 1
    rb.sample(global_steps=0, partition_id="train", batch_size=1)  # lists once more: its own start
    assert rb.stats()["polls"] == polls + 2
    # A call right after a sample() lists again at once, as verl's sampler does, and sees the clear.
    assert rb.get_sampleable_count(global_steps=0, partition_id="train") == 2
    assert rb.stats()["polls"] == polls + 3
    quiet = rb.stats()["polls"]
    time.sleep(1.0)
    assert rb.stats()["polls"] == quiet


def test_empty_failure_groups_pass_through_by_default_and_all_empty_raises(make, store) -> None:
    finished = produce(store, "train", "finished")
    produce(store, "train", "failure", sessions=0)
    rb = make()
    batch, metrics = rb.sample(global_steps=0, partition_id="train", batch_size=2)
    assert uids_of(batch.keys) == {finished} and verls(metrics) == {}
    produce(store, "train", "failure", sessions=0)
    with pytest.raises(RuntimeError, match="sync_refill_failed_groups"):
        rb.sample(global_steps=0, partition_id="train", batch_size=1)


def test_sync_failure_refill_replaces_empty_failed_groups(make, store) -> None:
    finished = produce(store, "train", "finished")
    produce(store, "train", "failure", sessions=0)
    refiller = Refiller(store, "train", step=1)
    rb = make(refill_fn=refiller, sync_refill_failed_groups=True, gen_batch_size=1)
    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=2)
    assert uids_of(batch.keys) == {finished, *refiller.produced} and refiller.calls == [1]
    assert verls(metrics) == {"training/rollout_failure/evicted_samples": 1}


def test_sync_ignores_staleness_and_validation_never_evicts(make, store) -> None:
    stale = produce(store, "train", "finished", step=0)
    fresh = produce(store, "train", "finished", step=5)
    val_failure = produce(store, "val", "failure", step=0)
    rb = make(threshold=1, refill_fn=Refiller(store, "train", 5), sync_refill_failed_groups=True, gen_batch_size=1)
    batch, metrics = rb.sample(global_steps=5, partition_id="train", batch_size=2)
    assert uids_of(batch.keys) == {stale, fresh} and verls(metrics) == {}
    batch, metrics = rb.sample(global_steps=5, partition_id="val", batch_size=1)
    assert uids_of(batch.keys) == {val_failure} and verls(metrics) == {}


def test_sync_dapo_reads_metrics_refills_twice_and_discards_surplus(make, store) -> None:
    same = produce(store, "train", "finished", sessions=2, rewards=[0.0, 0.0])
    mixed = produce(store, "train", "finished", sessions=2, rewards=[0.0, 1.0])
    refiller = Refiller(store, "train", step=1, sessions=2, rewards=[0.0, 1.0])
    rb = make(refill_fn=refiller, filter_groups_metric="acc", train_batch_size=2, gen_batch_size=1)
    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=2)
    sampled = uids_of(batch.keys)
    assert same not in sampled and mixed in sampled and refiller.calls == [2]
    assert verls(metrics) == {"training/filter_groups/evicted_samples": 1, DAPO_FILTERED_REWARD_COUNTS_KEY: {0.0: 1},
                       "training/filter_groups/discarded_surplus_samples": 1}
    surplus = (set(refiller.produced) - sampled).pop()
    listed = store.kv_list()["train"]
    assert same not in listed and f"{same}_0_0" not in listed  # evicted: prompt and trajectories
    assert surplus not in listed and f"{surplus}_1_0" not in listed


class SubmitOnly:
    """refill_fn that only registers pending prompts of step 1 (the agent loop runs them later), as verl's does."""

    def __init__(self, store: SqliteSource) -> None:
        self.store = store
        self.calls: list[list[str]] = []

    def __call__(self, n: int) -> int:
        uids = [uid() for _ in range(n)]
        self.store.kv_batch_put(uids, "train", tags=[{"is_prompt": True, "status": "pending", "global_steps": 1}] * n)
        self.calls.append(uids)
        return n

    def finish(self, uids: list[str]) -> None:
        """The agent loop runs them: groups with signal, all turning finished in one transaction. One finished
        while another is still in flight would free a credit, and the sampler would rightly dispatch it."""
        for key in uids:
            produce(self.store, "train", "running", sessions=2, rewards=[0.0, 1.0], key=key)
        self.store.kv_batch_put(uids, "train", tags=[{"status": "finished"}] * len(uids))


def _dapo_waiting(make, store: SqliteSource, filtered: int, batch_size: int) -> tuple[SubmitOnly, Consumer]:
    """``filtered`` groups without signal (2 credits each), 2 prompts allowed in flight, and a sync DAPO
    ``sample()`` of ``batch_size`` groups running in a thread."""
    for _ in range(filtered):
        produce(store, "train", "finished", sessions=2, rewards=[1.0, 1.0])
    refill = SubmitOnly(store)
    rb = make(refill_fn=refill, filter_groups_metric="acc", train_batch_size=2, gen_batch_size=1)
    consumer = Consumer(lambda: rb.sample(global_steps=1, partition_id="train", batch_size=batch_size))
    consumer.start()
    return refill, consumer


def test_sync_dapo_counts_what_refill_fn_just_submitted_as_in_flight(make, store) -> None:
    # Two filtered groups give 4 credits; only max_inflight_gen_batches * train_batch_size = 2 may be in flight.
    # refill_fn only registers pending prompts, as verl's does: the next decision must see them
    # (read-your-writes: the plan's clears and its refill are synced before it) or it dispatches the
    # remaining credit at once.
    refill, consumer = _dapo_waiting(make, store, filtered=2, batch_size=2)
    calls = refill.calls
    assert wait_until(lambda: len(calls) >= 1)
    time.sleep(0.5)
    assert [len(c) for c in calls] == [2] and consumer.is_alive()
    refill.finish(calls[0])
    batch, metrics = consumer.outcome()
    assert uids_of(batch.keys) == set(calls[0]) and len(calls) == 1
    assert verls(metrics)["training/filter_groups/evicted_samples"] == 2


def test_sync_dapo_refill_without_eviction_is_synced_before_the_next_decision(make, store) -> None:
    # Three filtered groups give 6 credits, 2 may be in flight. Once the first 2 prompts finish with
    # signal (3 are asked for), a plan dispatches 2 more and evicts nothing, so only the sync after
    # refill_fn shows the next decision those 2 in flight; without it the remaining 2 credits go at once.
    refill, consumer = _dapo_waiting(make, store, filtered=3, batch_size=3)
    calls = refill.calls
    assert wait_until(lambda: len(calls) >= 1)
    refill.finish(calls[0])
    assert wait_until(lambda: len(calls) >= 2)
    time.sleep(0.5)
    assert [len(c) for c in calls] == [2, 2] and consumer.is_alive()
    refill.finish(calls[1])
    batch, _ = consumer.outcome()
    assert uids_of(batch.keys) <= set(calls[0] + calls[1]) and len(uids_of(batch.keys)) == 3


def test_dapo_without_the_metric_is_a_clear_error(make, store) -> None:
    produce(store, "train", "finished", sessions=2)
    rb = make(refill_fn=print, filter_groups_metric="acc", train_batch_size=1, gen_batch_size=1)
    with pytest.raises(RuntimeError, match="missing DAPO metric 'acc'"):
        rb.sample(global_steps=0, partition_id="train", batch_size=1)


# -- async rules -----------------------------------------------------------------------------------

def test_async_drop_evicts_and_refills_inside_the_wait_with_verls_metrics(make, store) -> None:
    stale = produce(store, "train", "finished", step=0)
    boundary = produce(store, "train", "finished", step=4)
    fresh = produce(store, "train", "finished", step=5)
    inflight = produce(store, "train", "running", step=0)
    refiller = Refiller(store, "train", step=5)
    rb = make("colocate_async", threshold=2, refill_fn=refiller)
    batch, metrics = rb.sample(global_steps=5, partition_id="train", batch_size=3)
    sampled = uids_of(batch.keys)
    assert {boundary, fresh} <= sampled and stale not in sampled and inflight not in sampled
    assert refiller.calls == [1] and len(sampled & set(refiller.produced)) == 1
    assert verls(metrics) == {"training/off_policy/evicted_samples": 1,
                       "training/off_policy/evicted_samples_staleness/mean": 6.0,
                       "training/off_policy/evicted_samples_staleness/max": 6.0,
                       "training/off_policy/evicted_samples_staleness/min": 6.0}
    assert stale not in store.kv_list()["train"] and f"{stale}_0_0" not in store.kv_list()["train"]


def test_a_group_that_turns_stale_during_refill_is_dropped_on_the_next_view(make, store) -> None:
    stale_finished = produce(store, "train", "finished", step=0)
    stale_running = produce(store, "train", "running", step=0)

    def finish_first(call: int) -> None:
        if call == 0:
            store.kv_put(stale_running, "train", tag={"status": "finished"})

    refiller = Refiller(store, "train", step=5, before=finish_first)
    rb = make("colocate_async", threshold=1, refill_fn=refiller)
    batch, metrics = rb.sample(global_steps=5, partition_id="train", batch_size=1)
    assert uids_of(batch.keys) <= set(refiller.produced) and refiller.calls == [1, 1]
    assert verls(metrics)["training/off_policy/evicted_samples"] == 2
    assert {stale_finished, stale_running}.isdisjoint(store.kv_list()["train"])


def test_async_wait_strategy_holds_until_the_stale_prompt_finishes(make, store) -> None:
    fresh = [produce(store, "train", "finished", step=5) for _ in range(2)]
    stale = produce(store, "train", "running", step=0)
    rb = make("colocate_async", threshold=2, strategy="wait")
    consumer = Consumer(lambda: rb.sample(global_steps=5, partition_id="train", batch_size=2))
    consumer.start()
    assert wait_until(lambda: rb.stats()["decisions"] >= 1)
    time.sleep(0.3)
    assert consumer.is_alive()
    store.kv_put(stale, "train", tag={"status": "finished"})
    batch, metrics = consumer.outcome()
    assert uids_of(batch.keys) == {stale, fresh[0]} or len(uids_of(batch.keys)) == 2
    assert verls(metrics) == {}


def test_async_failure_evicts_and_refills_exactly(make, store) -> None:
    finished = produce(store, "train", "finished")
    failure = produce(store, "train", "failure")
    refiller = Refiller(store, "train", step=1)
    rb = make("colocate_async", refill_fn=refiller)
    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=2)
    assert uids_of(batch.keys) == {finished, *refiller.produced} and failure not in uids_of(batch.keys)
    assert refiller.calls == [1] and verls(metrics) == {"training/rollout_failure/evicted_samples": 1}


def test_sampleable_count_and_wait_for_sampleable_consume_nothing(make, store) -> None:
    fresh = produce(store, "train", "finished", step=5)
    stale = produce(store, "train", "finished", step=0)
    rb = make("colocate_async", threshold=1)
    assert rb.get_sampleable_count(global_steps=5, partition_id="train") == 1
    assert {fresh, stale} <= set(store.kv_list()["train"])
    pending = produce(store, "train", "running", step=5)
    waiter = Consumer(lambda: rb.wait_for_sampleable(global_steps=5, partition_id="train", target_count=2))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()
    store.kv_put(pending, "train", tag={"status": "finished"})
    sampleable, metrics = waiter.outcome()
    # The wait evicts what sample() would (no refill_fn here: nothing replaces it) and consumes nothing else.
    assert sampleable == {fresh, pending} and verls(metrics)["training/off_policy/evicted_samples"] == 1
    assert stale not in store.kv_list()["train"] and {fresh, pending} <= set(store.kv_list()["train"])
    assert rb.get_sampleable_count(global_steps=5, partition_id="train") == 2


# -- waits, errors, lifecycle ----------------------------------------------------------------------

def test_a_stuck_prompt_times_out_naming_it_and_progress_is_logged(make, store, caplog) -> None:
    stuck = produce(store, "train", "running", step=2)
    rb = make(sample_timeout=1.5, log_interval=0.2)
    # The poller starts (a process: seconds on a loaded machine) on a call before the one timed.
    assert rb.get_sampleable_count(global_steps=2, partition_id="train") == 0
    # The waiting is logged by buffer.sampling: the package's logger at INFO, whatever another test left the root at.
    with caplog.at_level(logging.INFO, logger="buffer"):
        with pytest.raises(TimeoutError, match=rf"batch_size=1\) timed out after 1\.5s: .*1 running.*in flight: {stuck}"):
            rb.sample(global_steps=2, partition_id="train", batch_size=1)
    assert any("waiting for" in r.getMessage() and "1 running" in r.getMessage() for r in caplog.records)


def test_an_unknown_status_is_a_clear_error_for_its_partition_only(make, store) -> None:
    store.kv_put("weird", "train", tag={"is_prompt": True, "status": "bogus", "global_steps": 0})
    fine = produce(store, "val", "finished")
    rb = make()
    with pytest.raises(ValueError, match="unknown status 'bogus'"):
        rb.sample(global_steps=0, partition_id="train", batch_size=1)
    batch, _ = rb.sample(global_steps=0, partition_id="val", batch_size=1)
    assert uids_of(batch.keys) == {fine}


def test_close_is_idempotent_and_wakes_a_waiter(make, store) -> None:
    rb = make()
    assert rb.get_sampleable_count(0, "train") == 0
    pid = rb.stats()["poller_pid"]
    consumer = Consumer(lambda: rb.sample(global_steps=0, partition_id="train", batch_size=1))
    consumer.start()
    assert wait_until(lambda: rb.stats()["wait_polls"] >= 2)  # waiting (polls change nothing: no new decision)
    report = rb.close()
    assert report.stage == "graceful" and rb.close() == report
    with pytest.raises(BufferClosed):
        consumer.outcome()
    assert not alive(pid)
    with pytest.raises(BufferClosed):
        rb.stats()


def test_a_dropped_sampler_takes_its_poller_along(db: str, store) -> None:
    produce(store, "train", "finished")
    rb = ReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=1,
                      max_off_policy_strategy="drop", sampler_kwargs={"source": SPEC, "source_kwargs": {"path": db}})
    assert rb.get_sampleable_count(0, "train") == 1
    pid = rb.stats()["poller_pid"]
    del rb
    gc.collect()
    assert wait_until(lambda: not alive(pid))


def test_a_trainer_constructor_that_fails_after_building_the_sampler_leaks_nothing(db: str) -> None:
    class Trainer:
        def __init__(self) -> None:
            self.replay_buffer = ReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=1,
                                              max_off_policy_strategy="drop",
                                              sampler_kwargs={"source": SPEC, "source_kwargs": {"path": db}})
            raise RuntimeError("a later init step failed")

    with pytest.raises(RuntimeError, match="later init step"):
        Trainer()
    # Nothing to undo: the sampler had started nothing (no_leaks checks processes, threads, fds, ipc dirs).


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_the_verl_v1_example_on_sqlite_runs_and_its_never_closed_sampler_leaves_no_poller(mode: str) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "examples/verl_v1_trainer.py", "--store", "sqlite", "--mode", mode,
                             "--steps", "3"], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    names = [event["event"] for event in events]
    assert names == ["trainer-built", "step", "step", "step", "fit-done", "store-closed"]
    assert all(event["groups"] == 4 for event in events if event["event"] == "step")
    assert wait_until(lambda: not alive(events[1]["poller_pid"]))


_EXITING_TRAINER = """
import json, logging, sys
from buffer.verl import ReplayBuffer

logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)

class Trainer:  # refill_fn ties trainer and sampler in a cycle, as in verl: no refcount frees them
    def __init__(self, db):
        self.replay_buffer = ReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=1,
                                          max_off_policy_strategy="drop", refill_fn=self.refill,
                                          sampler_kwargs={"source": "poller.sources.sqlite:SqliteSource",
                                                          "source_kwargs": {"path": db}})
    def refill(self, n):
        return n

trainer = Trainer(sys.argv[1])
trainer.replay_buffer.get_sampleable_count(0, "train")
print(json.dumps({"poller_pid": trainer.replay_buffer.stats()["poller_pid"]}), flush=True)
"""


def test_a_trainer_that_exits_without_closing_its_sampler_leaves_no_poller(db: str) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run([sys.executable, "-c", _EXITING_TRAINER, db], cwd=Path(__file__).resolve().parent.parent,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # At exit the sampler's finalizer closed the buffer itself (not just the poller noticing its parent die).
    assert "replay buffer closed: ShutdownReport(stage='graceful'" in result.stderr
    assert wait_until(lambda: not alive(json.loads(result.stdout)["poller_pid"]))
