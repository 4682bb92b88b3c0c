"""buffer.verl scenarios, run inside the store host (where TransferQueue is live, as in verl's trainer).

Each function takes ``tq.init()``'s config, drives the store the way verl's
trainer and agent loop write, asserts, closes what it opened and returns
observations for the test. Nothing here runs in the test process.
"""

from __future__ import annotations

import gc
import json
import threading
import time
import uuid
from typing import Any, Callable

from buffer.verl import DAPO_FILTERED_REWARD_COUNTS_KEY, ReplayBuffer
from poller.sources.transferqueue import source_kwargs
from tests.helpers.processes import is_running
from tests.helpers.verl import verls

POLL = 0.05
_held: dict[str, Any] = {}


def _uid() -> str:
    return uuid.uuid4().hex


def submit(pid: str, uids: list[str], step: int) -> None:
    """verl's _submit_batch_to_rollout: prompts registered as pending, tags only."""
    import transfer_queue as tq

    tq.kv_batch_put(keys=uids, partition_id=pid,
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": step} for _ in uids])


def agent_loop(pid: str, uid: str, step: int, *, status: str = "finished", sessions: int = 1,
               rewards: list[float] | None = None) -> list[str]:
    """verl's agent loop: running, each session's trajectory (data and tags), then the terminal status."""
    import torch
    import transfer_queue as tq

    tq.kv_put(key=uid, partition_id=pid, tag={"status": "running"})
    keys = []
    for session in range(sessions):
        fields: dict[str, Any] = {"input_ids": torch.tensor([1, 2, 3])}
        if rewards is not None:
            fields["extra_fields"] = {"reward_extra_info": {"acc": float(rewards[session])}}
        key = f"{uid}_{session}_0"
        tq.kv_put(key=key, partition_id=pid, fields=fields,
                  tag={"status": "success", "global_steps": step, "seq_len": 3})
        keys.append(key)
    if status != "running":
        tq.kv_put(key=uid, partition_id=pid, tag={"status": status})
    return keys


def group(pid: str, status: str, step: int = 0, **kwargs: Any) -> str:
    uid = _uid()
    submit(pid, [uid], step)
    agent_loop(pid, uid, step, status=status, **kwargs)
    return uid


def group_prompt_last(pid: str, status: str, step: int = 0, sessions: int = 1) -> str:
    """The order of verl's CPU tests: trajectories first, the prompt key (all its tags) after them."""
    import torch
    import transfer_queue as tq

    uid = _uid()
    for session in range(sessions):
        tq.kv_put(key=f"{uid}_{session}_0", partition_id=pid, fields={"input_ids": torch.tensor([1])},
                  tag={"status": "success", "global_steps": step})
    tq.kv_put(key=uid, partition_id=pid, tag={"is_prompt": True, "status": status, "global_steps": step})
    return uid


def listed(pid: str) -> dict[str, Any]:
    import transfer_queue as tq

    return tq.kv_list(pid).get(pid, {})


def uids_of(keys: list[str]) -> set[str]:
    return {key.split("_")[0] for key in keys}


def custom_path(mode: str, refill_fn: Any = None, threshold: int = 2, strategy: str = "drop",
                **sampler_kwargs: Any) -> ReplayBuffer:
    """verl's custom-sampler construction: six keywords; the source is found through Ray."""
    return ReplayBuffer(trainer_mode=mode, trainer_config={}, max_off_policy_threshold=threshold,
                        max_off_policy_strategy=strategy, refill_fn=refill_fn,
                        sampler_kwargs={"poll_interval": POLL, "sample_timeout": 60, **sampler_kwargs})


class Refill:
    """refill_fn writing synchronously: pending prompts whose rollouts finish before it returns."""

    def __init__(self, pid: str, step: int, sessions: int = 1, rewards: list[float] | None = None,
                 before: Callable[[int], None] | None = None) -> None:
        self.pid, self.step, self.sessions, self.rewards, self.before = pid, step, sessions, rewards, before
        self.calls: list[int] = []
        self.produced: list[str] = []

    def __call__(self, n: int) -> int:
        if self.before is not None:
            self.before(len(self.calls))
        self.calls.append(n)
        uids = [_uid() for _ in range(n)]
        submit(self.pid, uids, self.step)
        for uid in uids:
            agent_loop(self.pid, uid, self.step, sessions=self.sessions, rewards=self.rewards)
        self.produced.extend(uids)
        return n


def _closed(rb: ReplayBuffer) -> int:
    pid = rb.stats()["poller_pid"]
    assert rb.close().stage == "graceful"
    assert not is_running(pid)
    return pid


def sync_rules(conf: Any) -> dict[str, Any]:
    newest = group("train", "finished", step=5, sessions=2)
    oldest = group_prompt_last("train", "failure", step=1)
    middle = group("train", "finished", step=2, sessions=3)
    running = group("train", "running", step=0)
    rb = custom_path("sync")
    assert type(rb) is ReplayBuffer
    batch, metrics = rb.sample(global_steps=5, partition_id="train", batch_size=2)
    assert type(batch).__name__ == "KVBatchMeta" and batch.partition_id == "train" and verls(metrics) == {}
    assert uids_of(batch.keys) == {oldest, middle} and len(batch.keys) == 4
    assert all(tag["status"] == "success" for tag in batch.tags)
    now = listed("train")
    assert oldest not in now and middle not in now and newest in now and running in now
    assert set(batch.keys) <= set(now)  # trajectories are the trainer's to clear
    # Read-your-writes: the groups just handed out are not handed out again, even at once.
    again, _ = rb.sample(global_steps=5, partition_id="train", batch_size=1)
    assert uids_of(again.keys) == {newest}
    # Event-driven: a waiting sample returns when the agent loop finishes the last group.
    out: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: out.update(batch=rb.sample(global_steps=5, partition_id="train",
                                                                          batch_size=1)[0]))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive()
    import transfer_queue as tq

    finished_at = time.monotonic()
    tq.kv_put(key=running, partition_id="train", tag={"status": "finished"})
    waiter.join(60)
    latency = time.monotonic() - finished_at
    assert uids_of(out["batch"].keys) == {running}
    tq.kv_clear(keys=[*batch.keys, *again.keys, *out["batch"].keys], partition_id="train")
    # A stuck group: a bounded wait naming it.
    stuck = group("train", "running", step=6)
    timed = custom_path("sync", sample_timeout=1.0)
    message = "no TimeoutError"
    try:
        timed.sample(global_steps=6, partition_id="train", batch_size=1)
    except TimeoutError as exc:
        message = str(exc)
    assert stuck in message and "1 running" in message, message
    _closed(timed)
    # Validation never evicts: a stale failure group is handed out as it is.
    val_failure = group("val", "failure", step=0)
    val_batch, val_metrics = rb.sample(global_steps=9, partition_id="val", batch_size=1)
    assert uids_of(val_batch.keys) == {val_failure} and verls(val_metrics) == {}
    return {"latency_s": latency, "decisions": rb.stats()["decisions"], "poller_pid": _closed(rb)}


def between_calls(conf: Any) -> dict[str, Any]:
    """As verl's own sampler lists it, the store is listed when a call begins, and not between calls."""
    pid = f"calls-{_uid()}"
    group(pid, "finished")
    rb = custom_path("sync")
    first = rb.get_sampleable_count(global_steps=0, partition_id=pid)  # starts the poller
    polls = rb.stats()["polls"]
    time.sleep(3.0)
    idle_polls = rb.stats()["polls"] - polls
    group(pid, "finished")  # written while the trainer trains
    second = rb.get_sampleable_count(global_steps=0, partition_id=pid)
    return {"first": first, "second": second, "idle_polls": idle_polls,
            "polls_for_the_call": rb.stats()["polls"] - polls, "poller_pid": _closed(rb)}


def async_rules(conf: Any) -> dict[str, Any]:
    stale = group("train", "finished", step=0)
    boundary = group("train", "finished", step=4)
    failure = group("train", "failure", step=5)
    stale_running = group("train", "running", step=0)

    def finish_during_first_refill(call: int) -> None:
        if call == 0:  # the prompt turns terminal (and stale) while refill_fn runs
            import transfer_queue as tq

            tq.kv_put(key=stale_running, partition_id="train", tag={"status": "finished"})

    refill = Refill("train", step=5, before=finish_during_first_refill)
    # verl's built-in construction: every argument by position.
    rb = ReplayBuffer("colocate_async", {}, 2, "drop", {"source_kwargs": source_kwargs(conf), "poll_interval": POLL,
                                                         "sample_timeout": 60}, None, refill)
    assert type(rb).__name__ == "ReplayBufferAsync"
    assert rb.get_sampleable_count(global_steps=5, partition_id="train") == 1  # boundary only; nothing consumed
    assert {stale, failure} <= set(listed("train"))
    batch, metrics = rb.sample(global_steps=5, partition_id="train", batch_size=2)
    sampled = uids_of(batch.keys)
    assert boundary in sampled and len(sampled) == 2 and sampled - {boundary} <= set(refill.produced)
    assert {stale, failure, stale_running}.isdisjoint(listed("train"))
    assert verls(metrics)["training/off_policy/evicted_samples"] == 2
    assert verls(metrics)["training/rollout_failure/evicted_samples"] == 1
    assert sum(refill.calls) == 3
    # wait: dropless, holds while an in-flight prompt reached the threshold.
    import transfer_queue as tq

    tq.kv_clear(keys=list(listed("train")), partition_id="train")
    fresh = group("train", "finished", step=5)
    late = group("train", "running", step=3)  # span 3 >= 2
    waiting = custom_path("colocate_async", strategy="wait")
    out: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: out.update(r=waiting.wait_for_sampleable(5, "train", 1)))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive()
    tq.kv_put(key=late, partition_id="train", tag={"status": "finished"})
    waiter.join(60)
    assert out["r"] == ({fresh, late}, {})
    _closed(waiting)
    return {"refill_calls": refill.calls, "metrics": metrics, "poller_pid": _closed(rb)}


def dapo_rules(conf: Any) -> dict[str, Any]:
    same = group("train", "finished", step=1, sessions=2, rewards=[0.0, 0.0])
    mixed = group("train", "finished", step=1, sessions=2, rewards=[0.0, 1.0])
    refill = Refill("train", step=1, sessions=2, rewards=[0.0, 1.0])
    rb = custom_path("sync", refill, filter_groups_metric="acc", train_batch_size=2, gen_batch_size=1)
    batch, metrics = rb.sample(global_steps=1, partition_id="train", batch_size=2)
    sampled = uids_of(batch.keys)
    assert same not in sampled and mixed in sampled and refill.calls == [2], (sampled, refill.calls)
    assert verls(metrics) == {"training/filter_groups/evicted_samples": 1, DAPO_FILTERED_REWARD_COUNTS_KEY: {0.0: 1},
                       "training/filter_groups/discarded_surplus_samples": 1}, metrics
    surplus = (set(refill.produced) - sampled).pop()
    assert {same, f"{same}_0_0", surplus, f"{surplus}_1_0"}.isdisjoint(listed("train"))
    _closed(rb)
    # sync_refill_failed_groups: a failure group without trajectories is evicted and refilled.
    import transfer_queue as tq

    tq.kv_clear(keys=list(listed("train")), partition_id="train")
    finished = group("train", "finished", step=1)
    empty = group("train", "failure", step=1, sessions=0)
    refill = Refill("train", step=1)
    rb = custom_path("sync", refill, sync_refill_failed_groups=True, gen_batch_size=1)
    batch, failure_metrics = rb.sample(global_steps=1, partition_id="train", batch_size=2)
    assert uids_of(batch.keys) == {finished, *refill.produced} and refill.calls == [1]
    assert verls(failure_metrics) == {"training/rollout_failure/evicted_samples": 1} and empty not in listed("train")
    return {"metrics": {k: v for k, v in metrics.items() if not k.startswith("_")}, "poller_pid": _closed(rb)}


def hold_sampler(conf: Any) -> dict[str, Any]:
    """A sampler the way verl holds one: started, never closed (see drop_sampler)."""
    group("train", "finished", step=1)
    rb = custom_path("sync", sample_timeout=2.0)
    batch, _ = rb.sample(global_steps=1, partition_id="train", batch_size=1)
    _held["rb"] = rb
    return {"poller_pid": rb.stats()["poller_pid"], "keys": len(batch.keys)}


def drop_sampler(conf: Any) -> dict[str, Any]:
    """After tq.close(): waits are bounded, nothing hangs, and dropping the sampler stops its poller."""
    rb = _held.pop("rb")
    pid = rb.stats()["poller_pid"]
    started = time.monotonic()
    try:
        rb.sample(global_steps=1, partition_id="train", batch_size=1)
        outcome = "returned"
    except TimeoutError as exc:
        outcome = f"TimeoutError: {exc}"
    waited = time.monotonic() - started
    alive_after_close = is_running(pid)
    del rb
    gc.collect()
    deadline = time.monotonic() + 10
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"outcome": outcome, "waited_s": waited, "poller_alive_after_tq_close": alive_after_close,
            "poller_gone": not is_running(pid)}


def hold_across_reinit(conf: Any) -> dict[str, Any]:
    """Before the trainer re-initialises TransferQueue: buffer.verl and verl 0.9.1's own sampler, each handed a
    batch of the first controller and held (see sample_after_reinit); a group is left in that store."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer as VerlReplayBuffer

    for _ in range(3):
        group("train", "finished", step=0)
    rb = custom_path("sync", sample_timeout=30.0)
    oracle = VerlReplayBuffer("sync", {}, None, "drop", {}, poll_interval=POLL)
    sampled = [uids_of(sampler.sample(global_steps=0, partition_id="train", batch_size=1)[0].keys)
               for sampler in (rb, oracle)]
    old_keys = set(listed("train"))
    _held.update(rb=rb, oracle=oracle, old_keys=old_keys)
    return {"sampled": [sorted(uids) for uids in sampled], "old_keys": len(old_keys),
            "poller_pid": rb.stats()["poller_pid"]}


def sample_after_reinit(conf: Any) -> dict[str, Any]:
    """After tq.close() and tq.init() (a new controller on a new port): the held samplers on the new store.

    buffer.verl's sample() must hand out the new controller's group and show no key of the old one;
    verl's own sampler, given the same store back (the prompt key its rival cleared is put back as it
    was), is the oracle of what that batch is.
    """
    import transfer_queue as tq

    rb, oracle, old_keys = _held.pop("rb"), _held.pop("oracle"), _held.pop("old_keys")
    old_pid = rb.stats()["poller_pid"]
    fresh = group("train", "finished", step=1, sessions=2)
    prompt_tags = listed("train")[fresh]
    started = time.monotonic()
    try:
        batch, _ = rb.sample(global_steps=1, partition_id="train", batch_size=1)
        outcome, got = "returned", dict(zip(batch.keys, batch.tags))
    except TimeoutError as exc:
        outcome, got = f"TimeoutError: {exc}", {}
    waited = time.monotonic() - started
    held_keys, new_keys = rb.stats()["keys"], set(listed("train"))
    stats = rb.stats()
    tq.kv_put(key=fresh, partition_id="train", tag=prompt_tags)  # the store as buffer.verl found it
    expected_batch, _ = oracle.sample(global_steps=1, partition_id="train", batch_size=1)
    expected = dict(zip(expected_batch.keys, expected_batch.tags))
    new_pid = stats["poller_pid"]
    return {"outcome": outcome, "waited_s": waited, "batch": got, "expected": expected,
            "old_keys_in_batch": sorted(old_keys & set(got)), "keys_held": held_keys,
            "keys_in_new_store": len(new_keys), "fresh": fresh, "restarts": stats["restarts"],
            "switches": stats.get("source_switches"), "old_poller_gone": not is_running(old_pid),
            "new_poller": new_pid != old_pid, "poller_pid": _closed(rb)}


def built_by_verl(conf: Any) -> dict[str, Any]:
    """The sampler as verl 0.9.1 builds a custom one: its own loader and its own _build_replay_buffer."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.utils.import_utils import load_extern_type

    import buffer.verl

    assert load_extern_type("pkg://buffer.verl", "ReplayBuffer") is buffer.verl.ReplayBuffer
    out: dict[str, Any] = {}
    for mode in ("sync", "colocate_async"):
        refill = Refill("train", step=3, sessions=2, rewards=[0.0, 1.0])
        config = OmegaConf.create({"trainer": {"v1": {mode: {}, "sampler": {
            "custom_sampler": {"path": "pkg://buffer.verl", "name": "ReplayBuffer"},
            "max_off_policy_threshold": None, "max_off_policy_strategy": "drop",
            "sampler_kwargs": {"poll_interval": POLL, "sample_timeout": 60, "filter_groups_metric": "acc",
                               "train_batch_size": 1, "gen_batch_size": 1}}}}})
        # verl's own method on a stand-in trainer: exactly the keywords 0.9.1 passes a custom sampler.
        trainer = SimpleNamespace(config=config, trainer_mode=mode, _add_prompts_to_generate=refill)
        rb = PPOTrainer._build_replay_buffer(trainer)
        assert type(rb).__name__ == ("ReplayBuffer" if mode == "sync" else "ReplayBufferAsync")
        assert rb.refill_fn is refill and rb.max_off_policy_threshold is None and rb.filter_groups_metric == "acc"
        same = group("train", "finished", step=0, sessions=2, rewards=[1.0, 1.0])  # no signal: DAPO evicts it
        batch, metrics = rb.sample(global_steps=3, partition_id="train", batch_size=1)
        assert same not in uids_of(batch.keys) and uids_of(batch.keys) <= set(refill.produced)
        assert verls(metrics)["training/filter_groups/evicted_samples"] == 1 and refill.calls, (metrics, refill.calls)
        import transfer_queue as tq

        _closed(rb)
        tq.kv_clear(keys=list(listed("train")), partition_id="train")
        out[mode] = {"refill_calls": refill.calls, "metrics": {k: v for k, v in metrics.items() if "/" in k}}
    return out


def watched_finish(conf: Any) -> dict[str, Any]:
    """buffer.verl at verl's defaults, sample() waiting on a running prompt: its poller watches the prompt and the
    finish is listed by a listing the watch brought forward; the batch is the group the store holds."""
    import transfer_queue as tq

    uid = _uid()
    tq.kv_put(key=uid, partition_id="train", tag={"is_prompt": True, "status": "running", "global_steps": 1})
    rb = ReplayBuffer(trainer_mode="colocate_async", trainer_config={}, max_off_policy_threshold=None,
                      max_off_policy_strategy="drop", sampler_kwargs={}, refill_fn=None)
    try:
        outcome: list[Any] = []
        thread = threading.Thread(target=lambda: outcome.append(rb.sample(1, "train", 1)), daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while rb.stats().get("watch_reads", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        reads_before = rb.stats().get("watch_reads", 0)
        trajectories = [f"{uid}_0_0", f"{uid}_1_0"]
        tq.kv_batch_put(keys=trajectories + [uid], partition_id="train",
                        tags=[{"global_steps": 1, "status": "success"}] * 2
                        + [{"is_prompt": True, "status": "finished", "global_steps": 1}])
        thread.join(60)
        assert outcome, "sample() did not return"
        batch, _ = outcome[0]
        time.sleep(1.5)  # the heartbeat that carries the poller's counters
        stats = rb.stats()
        tq.kv_clear(keys=trajectories, partition_id="train")
        return {"reads_before": reads_before, "keys": sorted(batch.keys), "group": sorted(trajectories),
                "watch_listings": stats["watch_listings"], "watch_reads": stats["watch_reads"]}
    finally:
        _closed(rb)


def traced_sample(conf: Any, trace_file: str) -> dict[str, Any]:
    """One prompt finishing while ``sample()`` waits, with the product modules that run meanwhile recorded: in
    the sampler's poller (tests/helpers/trace_site) and in this process (tests/test_data_path.py's way)."""
    import os
    import sys

    import transfer_queue as tq

    from tests.helpers.tracing import ROOT, TRACE_SITE, Recorder

    uid = _uid()
    submit("train", [uid], 1)
    agent_loop("train", uid, 1, status="running")
    flag = trace_file + ".on"
    trainer = Recorder()
    # The poller child's path is this process's sys.path (buffer.process): it finds the trace site there.
    saved_path = list(sys.path)
    sys.path[:0] = [str(TRACE_SITE), str(ROOT)]
    os.environ["REPLAY_TRACE_FILE"] = trace_file
    threading.setprofile(trainer.profile)  # the buffer's threads start on the first call
    rb = custom_path("sync")
    try:
        try:
            assert rb.get_sampleable_count(global_steps=1, partition_id="train") == 0
        finally:
            threading.setprofile(None)  # type: ignore[arg-type]
            sys.path[:] = saved_path
            del os.environ["REPLAY_TRACE_FILE"]
        finished = threading.Thread(target=tq.kv_put, name="writer",
                                    kwargs={"key": uid, "partition_id": "train", "tag": {"status": "finished"}})
        open(flag, "w").close()
        trainer.recording.set()
        sys.setprofile(trainer.profile)
        try:
            finished.start()
            batch, _ = rb.sample(global_steps=1, partition_id="train", batch_size=1)
        finally:
            sys.setprofile(None)
            trainer.recording.clear()
            os.remove(flag)
            finished.join(30)
        deadline = time.monotonic() + 10
        while not os.path.exists(trace_file) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        report = rb.close()  # on a failure too: the sampler's poller must not outlive the scenario
    with open(trace_file) as out:
        poller = json.load(out)
    tq.kv_clear(keys=list(batch.keys), partition_id="train")
    return {"keys": list(batch.keys), "closed": report.stage, "poller": poller,
            "trainer": {thread: dict(modules) for thread, modules in trainer.modules.items() if thread != "writer"}}


def sample_after_the_controller_died(conf: Any) -> dict[str, Any]:
    """A sampler whose TransferQueue controller was killed under it: a call's TimeoutError names the call, its
    timeout, and for how long the store has not answered (not an inner wait of 0 s)."""
    import ray

    group("train", "finished", step=0)
    rb = custom_path("sync", sample_timeout=15.0)
    rb.sample(global_steps=0, partition_id="train", batch_size=1)  # the poller runs; the next call syncs first
    ray.kill(ray.get_actor("TransferQueueController", namespace="transfer_queue"), no_restart=True)
    started = time.monotonic()
    message = "no TimeoutError"
    try:
        rb.sample(global_steps=0, partition_id="train", batch_size=1)
    except TimeoutError as exc:
        message = str(exc)
    waited = time.monotonic() - started
    rb.close()
    return {"message": message, "waited_s": waited}
