"""verl's sampler classes: each call decides on the group index under the store's lock, then does its I/O."""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union, cast

from buffer.process import ShutdownReport
from buffer.verl import waiting
from buffer.verl.config import VERL_ATTRIBUTES, SamplerConfig
from buffer.verl.groups import (
    DrainState,
    GroupIndex,
    GroupPartition,
    Plan,
    accumulate_metrics,
    plan_async,
    plan_sync,
    sampleable_count,
)
from buffer.verl.link import StoreLink

__all__ = ["SAMPLER_METRICS", "WATCHED_PROMPTS", "ReplayBuffer", "ReplayBufferAsync", "VerlBatch"]

#: What a rule decides: a plan to carry out, or (get_sampleable_count) a count.
Decision = Union[Plan, int]

#: The most prompts a waiting call has its poller watch (poller.watch), newest first: reading them costs
#: TransferQueue's controller ~0.3 ms, a fraction of a listing at 100k keys.
WATCHED_PROMPTS = 64



#: The figures ``sample()`` adds to the metrics verl logs each step, under a prefix verl does not use.
SAMPLER_METRICS = {
    "sampler/wait_s": "seconds the call took, until it handed out its batch",
    "sampler/group_age_s/p50": "how long before the batch was handed out its groups were seen finished, median",
    "sampler/group_age_s/max": "the same, the oldest",
    "sampler/groups_left/pending": "prompt groups left in the partition, pending",
    "sampler/groups_left/running": "the same, running",
    "sampler/groups_left/finished": "the same, finished",
    "sampler/groups_left/failure": "the same, failure",
    "sampler/listings": "listings of the store the call asked for",
    "sampler/watch_reads": "reads of the prompts it waited on (as the poller's last heartbeat said)",
    "sampler/view_fresh": "1 when the view the call answered from was fresh, else 0",
}


def _ages(part: GroupPartition, uids: list[str]) -> list[float]:
    """Seconds since each terminal group of ``uids`` was first seen terminal (under the store's lock)."""
    now = time.monotonic()
    return [now - part.terminal_at[uid] for uid in uids if uid in part.terminal_at]


def _figures(waited: float, ages: list[float], left: dict[str, int], listings: int, reads: int,
             fresh: bool) -> dict[str, float]:
    ordered = sorted(ages)
    figures = {"sampler/wait_s": waited,
               "sampler/group_age_s/p50": ordered[len(ordered) // 2] if ordered else 0.0,
               "sampler/group_age_s/max": ordered[-1] if ordered else 0.0,
               "sampler/listings": float(listings), "sampler/watch_reads": float(reads),
               "sampler/view_fresh": 1.0 if fresh else 0.0}
    figures.update((f"sampler/groups_left/{status}", float(count)) for status, count in left.items())
    return figures


def check_call(name: str, global_steps: Any, partition_id: Any, count: Any = None,
                    count_name: str = "batch_size") -> str:
    """Check a sampler call's arguments; return the call as text, for its logs and errors.

    Raises:
        TypeError: ``global_steps`` is not an int, ``partition_id`` not a non-empty str.
        ValueError: the batch size / target count is not an int >= 0.
    """
    if not isinstance(global_steps, int) or isinstance(global_steps, bool):
        raise TypeError(f"global_steps must be an int, got {global_steps!r}")
    if not isinstance(partition_id, str) or not partition_id:
        raise TypeError(f"partition_id must be a non-empty str, got {partition_id!r}")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        raise ValueError(f"the batch size / target count must be an int >= 0, got {count!r}")
    tail = "" if count is None else f", {count_name}={count}"
    return f"{name}(global_steps={global_steps}, partition_id={partition_id!r}{tail})"


@dataclass
class VerlBatch:
    """A batch shaped like ``transfer_queue.KVBatchMeta``, used when TransferQueue is not loaded."""

    keys: list[str] = field(default_factory=list)
    tags: list[dict[str, Any]] = field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def size(self) -> int:
        return len(self.keys)


class ReplayBuffer:
    """verl's sampler, synchronous rules; ``trainer_mode != "sync"`` gives a :class:`ReplayBufferAsync`.

    Takes verl's constructor (keywords, or positions as verl's built-in
    class); verl's options may also come in ``sampler_kwargs``, with this
    sampler's own (:data:`~buffer.verl.config.SAMPLER_KWARGS`; docs/verl.md, "sampler_kwargs").

    ``max_off_policy_threshold=None`` turns off-policy version control off,
    as in verl 0.9.1: no staleness drop (``drop``), no staleness wait (``wait``).
    ``filter_groups_metric="reward"`` filters DAPO groups on each trajectory's
    summed ``rm_scores`` field; any other name reads
    ``extra_fields["reward_extra_info"][name]``.

    Raises:
        VerlConfigError: an option is out of range (verl's checks, in its words, and more), unknown, or
            given twice; both a ``ValueError`` and an ``AssertionError`` (verl asserts its threshold and strategy).
        TypeError: ``sampler_kwargs`` is not a mapping, or ``refill_fn`` is not callable.
    """

    _ASYNCHRONOUS = False

    def __new__(cls, *args: Any, **kwargs: Any) -> ReplayBuffer:
        if cls is ReplayBuffer:
            mode = kwargs["trainer_mode"] if "trainer_mode" in kwargs else (args[0] if args else "sync")
            if mode != "sync":
                cls = ReplayBufferAsync
        return super().__new__(cls)

    def __init__(self, trainer_mode: str, trainer_config: Any, max_off_policy_threshold: int | None,
                 max_off_policy_strategy: str, sampler_kwargs: Any, poll_interval: float | None = None,
                 refill_fn: Callable[[int], Any] | None = None, filter_groups_metric: str | None = None,
                 train_batch_size: int | None = None, gen_batch_size: int | None = None,
                 max_inflight_gen_batches: int = 1, sync_refill_failed_groups: bool = False) -> None:
        given = {"poll_interval": poll_interval, "filter_groups_metric": filter_groups_metric,
                 "train_batch_size": train_batch_size, "gen_batch_size": gen_batch_size,
                 "max_inflight_gen_batches": max_inflight_gen_batches,
                 "sync_refill_failed_groups": sync_refill_failed_groups}
        config = SamplerConfig.resolve(asynchronous=self._ASYNCHRONOUS, trainer_mode=trainer_mode,
                                       max_off_policy_threshold=max_off_policy_threshold,
                                       max_off_policy_strategy=max_off_policy_strategy,
                                       sampler_kwargs=sampler_kwargs, refill_fn=refill_fn, given=given)
        self._config = config  # verl's attributes too are read from it (__getattr__)
        self.trainer_config = trainer_config
        self.sampler_kwargs = sampler_kwargs
        self._index = GroupIndex()
        self._store = StoreLink(config, self._index)
        self._needs_fresh_view = False
        self._counters = {"decisions": 0, "syncs": 0, "refills": 0, "cleared_keys": 0, "batches": 0,
                          "wait_polls": 0}

    def __getattr__(self, name: str) -> Any:
        # verl's attributes (trainer_separate_async reads poll_interval), read from the options record.
        config = self.__dict__.get("_config")
        if name in VERL_ATTRIBUTES and config is not None:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        buffer = self._store.buffer
        state = "closed" if self._store.closed else ("running" if buffer is not None else "not started")
        return (f"<{type(self).__name__} mode={self.trainer_mode!r} {state} "
                f"poll_interval={self._config.poll_interval:g}s buffer={buffer!r}>")

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict[str, Any]]:
        """Hand out ``batch_size`` whole groups, oldest ``global_steps`` first, after the mode's evictions.

        Returns every trajectory of the chosen groups with its tags (a
        ``KVBatchMeta``) and the metrics verl logs: the eviction metrics accrued
        while waiting, and this sampler's own figures of the call under
        ``sampler/`` (a prefix verl does not use; :data:`SAMPLER_METRICS`). The
        chosen prompt keys are cleared; the trainer clears the trajectories after its step.

        Raises:
            TimeoutError: ``sample_timeout`` passed (the message names the prompts in flight).
            RuntimeError: no chosen group has a trajectory (enable sync_refill_failed_groups),
                or finished DAPO groups lack the metric.
            ValueError: a prompt in the partition has an unknown status.
            PollerCrashed, BufferClosed: the poller is dead for good / the sampler was closed.
        """
        what = check_call("sample", global_steps, partition_id, batch_size)
        config, state = self._config, DrainState()
        started, asked, reads = time.monotonic(), self._counters["syncs"] + self._counters["wait_polls"], self._reads()
        plan, metrics = self._run(what, partition_id, lambda part: (
            plan_async(part, config, partition_id, global_steps, batch_size, True) if config.asynchronous
            else plan_sync(part, config, partition_id, global_steps, batch_size, state)))
        assert isinstance(plan, Plan) and plan.select is not None
        if not config.asynchronous and partition_id != "val" and not plan.select_keys:
            message = "Sync replay buffer selected terminal groups with no materializable trajectories."
            if not config.sync_refill_failed_groups:
                message += " Enable trainer.v1.sampler.sync_refill_failed_groups to replace failed groups."
            raise RuntimeError(message)
        sampling = self._store.start().sampling
        waited = time.monotonic() - started
        held = sampling.tags(partition_id, plan.select_keys)
        keys = [key for key in plan.select_keys if key in held]
        ages = sampling.look(lambda: _ages(self._index.partition(partition_id), plan.select or []))
        self._clear(partition_id, plan.select)
        self._counters["batches"] += 1
        tags = [held[key] for key in keys]
        left = sampling.look(lambda: self._index.partition(partition_id).counts())
        metrics.update(_figures(waited, ages, left, self._counters["syncs"] + self._counters["wait_polls"] - asked,
                                self._reads() - reads, sampling.not_fresh() is None))
        if self._store.on_transferqueue or "transfer_queue" in sys.modules:  # the type verl's trainer expects
            meta = importlib.import_module("transfer_queue").KVBatchMeta
            return meta(partition_id=partition_id, keys=keys, tags=tags), metrics
        return VerlBatch(keys=keys, tags=tags, partition_id=partition_id), metrics

    def get_sampleable_count(self, global_steps: int, partition_id: str) -> int:
        """How many terminal groups the rules would let ``sample`` hand out now (nothing is consumed)."""
        what = check_call("get_sampleable_count", global_steps, partition_id)
        count, _ = self._run(what, partition_id,
                             lambda part: sampleable_count(part, self._config, partition_id, global_steps))
        assert isinstance(count, int)
        return count

    def close(self, timeout: float | None = None) -> ShutdownReport:
        """Stop the poller and release everything; idempotent. verl never calls it: the finalizer does."""
        return self._store.close(timeout)

    def stats(self) -> dict[str, Any]:
        """The buffer's ``stats()`` (once started) plus this sampler's counters and groups by status."""
        buffer = self._store.running()
        out: dict[str, Any] = {"started": buffer is not None, **self._counters}
        if buffer is not None:
            out.update(buffer.stats())
            out["groups"] = buffer.sampling.look(lambda: {pid: self._index.partition(pid).counts()
                                                      for pid in self._index.partition_ids()})
        return out

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _reads(self) -> int:
        """The poller's reads of watched keys so far, as its last heartbeat said (0: not started)."""
        buffer = self._store.buffer
        return buffer.sampling.watch_reads() if buffer is not None else 0

    def _run(self, what: str, partition_id: str,
             rule: Callable[[GroupPartition], Decision | None]) -> tuple[Decision, dict[str, Any]]:
        """Decide and carry out plans until one hands out, is ready or is a count; with the eviction metrics."""
        timeout = self._config.sample_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        metrics: dict[str, Any] = {}
        # As verl's own sampler, every call decides on a listing that began after it started.
        self._needs_fresh_view = True
        while True:
            result = self._decide(what, partition_id, deadline, rule)
            if isinstance(result, int) or not self._carry_out(result, what, partition_id, metrics, deadline):
                return result, metrics

    def _decide(self, what: str, partition_id: str, deadline: float | None,
                rule: Callable[[GroupPartition], Decision | None]) -> Decision:
        """The first non-None ``rule(view)`` on a whole view, re-run when the partition's groups changed."""
        sampling = self._store.start(partition_id).sampling
        # A poller this call started, or one moved to the controller the trainer re-initialised: no decision is
        # made before its first complete listing, which began after the call.
        if self._store.started_now or self._store.follow():
            self._needs_fresh_view = self._store.include(partition_id)
        elif self._store.include(partition_id):
            self._needs_fresh_view = True
        if self._needs_fresh_view:
            self._read_your_writes(what, deadline)

        def attempt() -> Decision | None:
            self._counters["decisions"] += 1
            return rule(self._index.partition(partition_id))

        def counted_poll() -> None:
            self._counters["wait_polls"] += 1

        config = self._config
        try:
            return cast(Decision, waiting.decide(
                sampling, attempt, partition_id=partition_id,
                timeout=None if deadline is None else max(0.0, deadline - time.monotonic()),
                describe=lambda: self._index.partition(partition_id).describe(partition_id),
                log_every=config.log_interval, what=what, poll_every=config.poll_interval,
                on_poll=counted_poll, version=lambda: self._index.version(partition_id),
                watch=lambda: self._index.partition(partition_id).in_flight(WATCHED_PROMPTS)))
        except TimeoutError as exc:
            stale = sampling.not_fresh()  # the store may have stopped answering after the call's first listing
            note = f"; {stale}" if stale is not None and stale not in str(exc) else ""
            raise TimeoutError(f"{what} timed out after {config.sample_timeout:g}s: {exc}{note}") from None

    def _carry_out(self, plan: Plan, what: str, partition_id: str, metrics: dict[str, Any],
                   deadline: float | None) -> bool:
        """Do the plan's I/O; True when the caller must decide again."""
        if plan.fetch:
            self._fetch(partition_id, plan.fetch)
            return True
        if plan.error is not None:
            raise plan.error
        if plan.clear:
            self._clear(partition_id, plan.clear)
            accumulate_metrics(metrics, plan.metrics)
        if plan.refill:
            assert self._config.refill_fn is not None
            self._counters["refills"] += 1
            self._config.refill_fn(plan.refill)
            # What refill_fn wrote (synchronously) is in the next view.
            self._read_your_writes(what, deadline, after="refill_fn")
        return plan.select is None and not plan.ready

    def _read_your_writes(self, what: str, deadline: float | None, after: str = "its clears") -> None:
        """Wait for a listing that began after this call: it shows the sampler's own clears and refills.

        Raises:
            TimeoutError: ``sample_timeout`` passed first; the message names the call and, when the store stopped
                answering, for how long it has not.
        """
        sampling = self._store.start().sampling
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._counters["syncs"] += 1
        try:
            sampling.sync(remaining)
        except TimeoutError:
            stale = sampling.not_fresh()
            raise TimeoutError(f"{what} timed out after {self._config.sample_timeout:g}s: no listing of the store "
                               f"that began after {after} was applied" + (f"; {stale}" if stale else "")) from None
        self._needs_fresh_view = False

    def _clear(self, partition_id: str, keys: list[str]) -> None:
        """Clear keys in the store and forget them here at once; the next decision syncs first."""
        sampling = self._store.start().sampling
        self._store.clear(partition_id, keys)
        sampling.forget_cleared(partition_id, keys)
        self._counters["cleared_keys"] += len(keys)
        self._needs_fresh_view = True

    def _fetch(self, partition_id: str, groups: dict[str, list[str]]) -> None:
        """Read the DAPO metric of newly finished groups (outside the lock) and record it in the index."""
        sampling = self._store.start().sampling
        assert self._config.filter_groups_metric is not None
        classes = self._store.classify(partition_id, groups, self._config.filter_groups_metric)

        def record() -> None:  # refused for a group whose trajectories changed since: it is read again
            for uid, (keys, value) in classes.items():
                self._index.record_metric(partition_id, uid, keys, value)

        sampling.look(record)


class ReplayBufferAsync(ReplayBuffer):
    """verl's sampler with the asynchronous rules (staleness drop/wait, failure eviction, refill k)."""

    _ASYNCHRONOUS = True

    def wait_for_sampleable(self, global_steps: int, partition_id: str,
                            target_count: int) -> tuple[set[str], dict[str, Any]]:
        """Wait until ``target_count`` groups are sampleable, evicting and refilling meanwhile.

        Returns their uids and the eviction metrics; nothing is consumed.
        """
        what = check_call("wait_for_sampleable", global_steps, partition_id, target_count, "target_count")
        plan, metrics = self._run(what, partition_id, lambda part: plan_async(part, self._config, partition_id,
                                                                              global_steps, target_count, False))
        assert isinstance(plan, Plan)
        return plan.sampleable, metrics
