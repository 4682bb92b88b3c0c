"""verl's groups: the index the store keeps, and the rules that decide over it.

verl writes two kinds of keys into one partition::

    {uid}                  the prompt: {"is_prompt": True, "status": ..., "global_steps": g}
    {uid}_{session}_{i}    its trajectories (any tags; "status": "success")

A prompt's ``status`` moves pending -> running -> finished | failure; a group (the prompt and its
trajectories) is *terminal* once its prompt is finished or failure. Sections, in order:

- The index: :class:`GroupIndex`, a store policy, is told every key that changed under the store's lock and
  updates only what that key touches. Prompts are bucketed per status by ``global_steps``, so the rules touch
  only the buckets they need. Each partition's *version* moves exactly when what the rules read in it
  changes: a waiting decision is re-run only on a new one.
- The rules: one decision per view, under the store's lock and with no I/O: a :class:`Plan`, which the
  sampler carries out with the lock released, or ``None`` (nothing to do until the view changes, where verl
  sleeps ``poll_interval``).

Eviction, per mode (``k`` groups evicted; ``"val"`` never evicts):

- stale (strategy ``drop``): async evicts k and refills k; sync: no-op.
- DAPO (``filter_groups_metric``): async evicts k and refills k; sync evicts k, refill credit 2k.
- failure: async evicts k and refills k; sync keeps them (padded), or with ``sync_refill_failed_groups``
  evicts the failure groups without trajectories and refills k.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Any

from buffer.verl.config import SamplerConfig
from poller.wire.vocabulary import FAILURE, FINISHED, PENDING, PROMPT_STATUSES, RUNNING, Tags

__all__ = ["DAPO_FILTERED_REWARD_COUNTS_KEY", "DrainState", "GroupIndex", "GroupPartition", "Plan",
           "accumulate_metrics", "classify", "metrics_prefix", "uid_of"]


# -- the index -----------------------------------------------------------------------

#: What of a prompt's tags its group depends on; a trajectory's tags never move a group.
_GROUP_TAGS = ("is_prompt", "status", "global_steps")


def uid_of(key: str) -> str:
    """The group a key belongs to: the part before the first ``_`` (verl's rule)."""
    return key.partition("_")[0]


class GroupPartition:
    """The groups of one partition. Read it under the store's lock."""

    __slots__ = ("status", "step", "buckets", "trajectories", "invalid", "unclassified", "filtered", "terminal_at")

    def __init__(self) -> None:
        #: uid -> status of every valid prompt.
        self.status: dict[str, str] = {}
        #: uid -> the prompt's ``global_steps``.
        self.step: dict[str, int] = {}
        #: status -> step -> uids (in arrival order).
        self.buckets: dict[str, dict[int, dict[str, None]]] = {status: {} for status in PROMPT_STATUSES}
        #: uid -> its trajectory keys (in arrival order); a uid may have no prompt (yet).
        self.trajectories: dict[str, dict[str, None]] = {}
        #: prompt key -> why it cannot be used (unknown status, no integer global_steps).
        self.invalid: dict[str, str] = {}
        #: finished uids whose DAPO metric has not been read yet.
        self.unclassified: dict[str, None] = {}
        #: finished uid -> the metric value all its trajectories share (DAPO filters it).
        self.filtered: dict[str, float] = {}
        #: terminal uid -> when the view first showed it finished or failed (time.monotonic()).
        self.terminal_at: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"<GroupPartition {self.counts()} groups_with_trajectories={len(self.trajectories)}>"

    def counts(self) -> dict[str, int]:
        return {status: self.count(status) for status in PROMPT_STATUSES}

    def describe(self, partition_id: str) -> str:
        """Counts by status and the oldest prompts in flight (for timeouts and progress logs)."""
        inflight = list(islice(chain(self.uids(RUNNING), self.uids(PENDING)), 5))
        return (f"partition {partition_id!r} holds {self.count(PENDING)} pending, {self.count(RUNNING)} running, "
                f"{self.count(FINISHED)} finished and {self.count(FAILURE)} failure prompt(s)"
                + (f"; in flight: {', '.join(inflight)}" if inflight else ""))

    def count(self, *statuses: str) -> int:
        return sum(len(uids) for status in statuses for uids in self.buckets[status].values())

    def uids(self, *statuses: str, newest_first: bool = False) -> Iterator[str]:
        """uids of ``statuses``, oldest ``global_steps`` first, each step's in arrival order (or all reversed)."""
        buckets = [self.buckets[status] for status in statuses]
        for step in sorted({step for bucket in buckets for step in bucket}, reverse=newest_first):
            for bucket in buckets:
                uids = bucket.get(step, {})
                yield from reversed(uids) if newest_first else uids

    def in_flight(self, limit: int) -> list[str]:
        """Up to ``limit`` prompts not yet terminal, newest ``global_steps`` and latest arrival first.

        The likeliest to finish soonest: the poller watches them while a decision waits.
        """
        return list(islice(self.uids(PENDING, RUNNING, newest_first=True), limit))

    def older_than(self, status: str, step: int) -> list[str]:
        """uids of ``status`` whose prompt ``global_steps`` is below ``step``."""
        bucket = self.buckets[status]
        return [uid for s in sorted(bucket) if s < step for uid in bucket[s]]

    def min_step(self, statuses: Iterable[str]) -> int | None:
        steps = [min(self.buckets[status]) for status in statuses if self.buckets[status]]
        return min(steps) if steps else None

    def trajectory_keys(self, uids: Iterable[str]) -> list[str]:
        return [key for uid in uids for key in self.trajectories.get(uid, ())]

    def _forget_metric(self, uid: str) -> None:
        # A group's trajectories changed: what was read of them is stale (a finished group's is read again).
        self.filtered.pop(uid, None)
        if self.status.get(uid) == FINISHED:
            self.unclassified[uid] = None

    def _index(self, key: str, tags: Tags) -> None:
        if tags.get("is_prompt"):
            status: Any = tags.get("status")
            step: Any = tags.get("global_steps")
            if not isinstance(status, str) or status not in PROMPT_STATUSES:
                self.invalid[key] = (f"prompt {key!r} has unknown status {status!r} "
                                     f"(expected one of {', '.join(PROMPT_STATUSES)})")
                return
            if not isinstance(step, int) or isinstance(step, bool):
                self.invalid[key] = f"prompt {key!r} has no integer global_steps (got {step!r})"
                return
            self.status[key] = status
            self.step[key] = step
            self.buckets[status].setdefault(step, {})[key] = None
            if status == FINISHED:
                self.unclassified[key] = None
            return
        uid = uid_of(key)
        self.trajectories.setdefault(uid, {})[key] = None
        self._forget_metric(uid)

    def _unindex(self, key: str, tags: Tags) -> None:
        if tags.get("is_prompt"):
            if self.invalid.pop(key, None) is not None:
                return
            status = self.status.pop(key, None)
            if status is None:
                return
            step = self.step.pop(key)
            bucket = self.buckets[status]
            uids = bucket[step]
            del uids[key]
            if not uids:
                del bucket[step]
            self.unclassified.pop(key, None)
            self._forget_metric(key)  # no longer a prompt: not unclassified again
            return
        uid = uid_of(key)
        keys = self.trajectories.get(uid)
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self.trajectories[uid]
        self._forget_metric(uid)


def _group_tags(tags: Tags) -> tuple[Any, ...] | None:
    return (tags.get("status"), tags.get("global_steps")) if tags.get("is_prompt") else None


_EMPTY = GroupPartition()


class GroupIndex:
    """A store policy keeping every partition's groups: ``on_change`` never raises nor calls back into the store."""

    indexed_tags = _GROUP_TAGS

    def __init__(self) -> None:
        self._parts: dict[str, GroupPartition] = {}
        #: partition -> the stamp of the last change of its groups. Dropped with the partition's last
        #: group: stamps only grow, so a partition that comes back never shows a version seen before.
        self._versions: dict[str, int] = {}
        self._stamp = 0

    def __repr__(self) -> str:
        return f"<GroupIndex partitions={sorted(self._parts)} stamp={self._stamp}>"

    def on_change(self, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        if old is not None and new is not None and _group_tags(old) == _group_tags(new):
            return  # a trajectory's tags, or a prompt's other tags, changed: no group did
        part = self._parts.get(partition_id)
        if part is None:
            if new is None:
                return
            part = self._parts[partition_id] = GroupPartition()
        self._touch(partition_id)
        if old is not None:
            part._unindex(key, old)
        if new is not None:
            part._index(key, new)
        if part.status.get(key) in TERMINAL:
            part.terminal_at.setdefault(key, time.monotonic())
        else:
            part.terminal_at.pop(key, None)
        if not (part.status or part.trajectories or part.invalid):
            del self._parts[partition_id]
            del self._versions[partition_id]

    def partition(self, partition_id: str) -> GroupPartition:
        """The groups of ``partition_id`` (an empty, shared view if it has none); read it under the lock."""
        return self._parts.get(partition_id, _EMPTY)

    def version(self, partition_id: str) -> int:
        """Changes whenever what the rules read of ``partition_id`` changes (0: no groups); under the lock."""
        return self._versions.get(partition_id, 0)

    def record_metric(self, partition_id: str, uid: str, keys: list[str], value: float | None) -> bool:
        """Keep the DAPO classification of a finished group read from ``keys``; under the lock.

        Refused (False) when the group is no longer finished or its
        trajectories changed since they were read: it is read again.
        """
        part = self._parts.get(partition_id)
        if part is None or uid not in part.unclassified or list(part.trajectories.get(uid, ())) != keys:
            return False
        del part.unclassified[uid]
        if value is not None:
            part.filtered[uid] = value
        self._touch(partition_id)  # the rules read the classification
        return True

    def _touch(self, partition_id: str) -> None:
        self._stamp += 1
        self._versions[partition_id] = self._stamp

    def partition_ids(self) -> list[str]:
        return list(self._parts)


# -- the rules -----------------------------------------------------------------------

#: The dict-valued metric verl logs as a table: ``{shared metric value: groups filtered}``.
DAPO_FILTERED_REWARD_COUNTS_KEY = "_dapo_filtered_reward_counts"

TERMINAL = (FINISHED, FAILURE)
INFLIGHT = (PENDING, RUNNING)


def metrics_prefix(partition_id: str) -> str:
    return "training" if partition_id == "train" else "validation"


@dataclass
class DrainState:
    """Sync DAPO's state across the decisions of one ``sample()``."""

    credit: int = 0
    draining: bool = False


@dataclass
class Plan:
    """One decision. Carried out in this order: fetch, error, clear, refill, select."""

    #: uid -> trajectory keys whose DAPO metric must be read before deciding.
    fetch: dict[str, list[str]] = field(default_factory=dict)
    error: Exception | None = None
    #: the groups evicted, how many of them for failure and for DAPO (verl's refills count them).
    evict: set[str] = field(default_factory=set)
    failed: int = 0
    filtered: int = 0
    #: every key to clear (prompts and trajectories): the evicted groups' and, in sync DAPO, the surplus's.
    clear: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    refill: int = 0
    #: sampleable groups reached the target (wait_for_sampleable).
    ready: bool = False
    sampleable: set[str] = field(default_factory=set)
    #: groups handed out (oldest first) and their trajectory keys.
    select: list[str] | None = None
    select_keys: list[str] = field(default_factory=list)


def _evictions(part: GroupPartition, config: SamplerConfig, partition_id: str, global_steps: int) -> Plan:
    """The groups evicted now, with verl's metrics; or a plan that must come first (an error, DAPO metrics to read)."""
    if part.invalid:
        return Plan(error=ValueError(f"Unknown status or malformed prompt in partition {partition_id!r}: "
                                     + "; ".join(list(part.invalid.values())[:5])))
    if config.dapo_on(partition_id) and part.unclassified:
        return Plan(fetch={uid: list(part.trajectories.get(uid, ())) for uid in part.unclassified})
    stale: set[str] = set()
    dapo: set[str] = set(part.filtered) if config.dapo_on(partition_id) else set()
    failed: set[str] = set()
    if partition_id != "val" and config.asynchronous:
        if config.max_off_policy_strategy == "drop" and config.max_off_policy_threshold is not None:
            # Span global_steps - step + 1 above the threshold: step < global_steps + 1 - threshold.
            stale = set(part.older_than(FINISHED, global_steps + 1 - config.max_off_policy_threshold))
        failed = set(part.uids(FAILURE))
    elif partition_id != "val" and config.sync_refill_failed_groups:
        failed = {uid for uid in part.uids(FAILURE) if uid not in part.trajectories}
    plan = Plan(evict=stale | dapo | failed, failed=len(failed), filtered=len(dapo))
    if not plan.evict:
        return plan
    plan.clear = [*plan.evict, *part.trajectory_keys(plan.evict)]
    prefix = metrics_prefix(partition_id)
    if stale:
        spans = [float(global_steps - part.step[uid] + 1) for uid in stale]
        plan.metrics.update({
            f"{prefix}/off_policy/evicted_samples": len(spans),
            f"{prefix}/off_policy/evicted_samples_staleness/mean": sum(spans) / len(spans),
            f"{prefix}/off_policy/evicted_samples_staleness/max": max(spans),
            f"{prefix}/off_policy/evicted_samples_staleness/min": min(spans),
        })
    if dapo:
        plan.metrics[f"{prefix}/filter_groups/evicted_samples"] = len(dapo)
        plan.metrics[DAPO_FILTERED_REWARD_COUNTS_KEY] = dict(Counter(part.filtered[uid] for uid in dapo))
    if failed:
        plan.metrics[f"{prefix}/rollout_failure/evicted_samples"] = len(failed)
    return plan


def _select(part: GroupPartition, plan: Plan, n: int) -> None:
    plan.select = list(islice((uid for uid in part.uids(*TERMINAL) if uid not in plan.evict), n))
    plan.select_keys = part.trajectory_keys(plan.select)


def sampleable_count(part: GroupPartition, config: SamplerConfig, partition_id: str, global_steps: int) -> Plan | int:
    """Terminal groups the rules would not evict (or a plan to read DAPO metrics first)."""
    plan = _evictions(part, config, partition_id, global_steps)
    return plan if plan.fetch or plan.error else part.count(*TERMINAL) - len(plan.evict)


def plan_sync(part: GroupPartition, config: SamplerConfig, partition_id: str, global_steps: int, batch_size: int,
              state: DrainState) -> Plan | None:
    """One step of verl's synchronous ``sample()``; ``state`` carries DAPO's refill credit."""
    plan = _evictions(part, config, partition_id, global_steps)
    if plan.fetch or plan.error:
        return plan
    has_enough = part.count(*TERMINAL) - len(plan.evict) >= batch_size
    inflight = part.count(*INFLIGHT)
    dapo = config.dapo_on(partition_id)
    if not dapo and plan.failed and not has_enough:
        plan.refill = plan.failed
        return plan
    if dapo:
        if has_enough:
            # Enough: stop dispatching and drain what is in flight under this policy version.
            state.draining, state.credit = True, 0
        elif not state.draining:
            state.credit += 2 * plan.filtered + plan.failed
        if not state.draining and state.credit > 0:
            assert config.train_batch_size is not None and config.gen_batch_size is not None
            slots = max(0, config.max_inflight_gen_batches * config.train_batch_size - inflight)
            dispatch = min(state.credit, slots)
            dispatch -= dispatch % config.gen_batch_size
            if dispatch > 0:
                state.credit -= dispatch
                plan.refill = dispatch
                return plan
    if has_enough and (not dapo or inflight == 0):
        _select(part, plan, batch_size)
        if dapo:
            # Sync stays bufferless: what is terminal beyond the batch is discarded.
            chosen = set(plan.select or ())
            surplus = {uid for uid in part.uids(*TERMINAL) if uid not in chosen and uid not in plan.evict}
            if surplus:
                plan.clear += [*surplus, *part.trajectory_keys(surplus)]
                plan.metrics[f"{metrics_prefix(partition_id)}/filter_groups/discarded_surplus_samples"] = len(surplus)
        return plan
    return plan if plan.evict else None


def plan_async(part: GroupPartition, config: SamplerConfig, partition_id: str, global_steps: int, target: int,
               select: bool) -> Plan | None:
    """One step of verl's ``wait_for_sampleable()`` (and, with ``select``, of ``sample()``)."""
    plan = _evictions(part, config, partition_id, global_steps)
    if plan.fetch or plan.error:
        return plan
    if plan.evict:
        plan.refill = len(plan.evict) if config.refill_fn is not None else 0
        return plan
    if config.max_off_policy_strategy == "wait" and config.max_off_policy_threshold is not None:
        # Dropless: not ready while an in-flight prompt has reached the threshold (span >= threshold).
        # verl 0.9.1 holds validation too (its _has_enough_samples does not look at the partition).
        oldest = part.min_step(INFLIGHT)
        if oldest is not None and global_steps - oldest + 1 >= config.max_off_policy_threshold:
            return None
    if part.count(*TERMINAL) < target:
        return None
    plan.ready = True
    if select:
        _select(part, plan, target)
    else:
        plan.sampleable = set(part.uids(*TERMINAL))
    return plan


def classify(values: list[float]) -> float | None:
    """The value all of a group's trajectories share (DAPO filters it), else None; one trajectory has signal."""
    if len(values) > 1 and all(value == values[0] for value in values):
        return float(values[0])
    return None


def accumulate_metrics(acc: dict[str, Any], new: dict[str, Any]) -> None:
    """Fold one decision's eviction metrics into ``acc`` the way verl does.

    Counts add up, the staleness mean stays a per-sample mean, max/min stay extremes, the DAPO table merges.
    """
    stale_key = next((key for key in new if key.endswith("/off_policy/evicted_samples")), None)
    before = acc.get(stale_key, 0) if stale_key else 0
    stale_count = new[stale_key] if stale_key else 0
    for key, value in new.items():
        if key.endswith("/evicted_samples_staleness/mean"):
            total = before + stale_count
            acc[key] = (acc.get(key, 0.0) * before + value * stale_count) / total if total else value
        elif key.endswith("/evicted_samples_staleness/max"):
            acc[key] = max(acc.get(key, value), value)
        elif key.endswith("/evicted_samples_staleness/min"):
            acc[key] = min(acc.get(key, value), value)
        elif key == DAPO_FILTERED_REWARD_COUNTS_KEY:
            acc[key] = dict(Counter(acc.get(key, {})) + Counter(value))
        else:
            acc[key] = acc.get(key, 0) + value
