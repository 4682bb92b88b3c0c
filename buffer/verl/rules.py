"""verl's sampling rules over a :class:`~buffer.verl.groups.GroupPartition`: one decision per view.

Every function here runs with the store lock held and does no I/O: it returns a
:class:`Plan`, which the sampler carries out with the lock released, or ``None``
(nothing to do until the view changes, where verl sleeps ``poll_interval``).

Eviction, per mode (``k`` groups evicted; ``"val"`` never evicts):

- stale (strategy ``drop``): async evicts k and refills k; sync: no-op.
- DAPO (``filter_groups_metric``): async evicts k and refills k; sync evicts k, refill credit 2k.
- failure: async evicts k and refills k; sync keeps them (padded), or with ``sync_refill_failed_groups``
  evicts the failure groups without trajectories and refills k.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from buffer.verl.config import SamplerConfig
from buffer.verl.groups import GroupPartition
from poller.wire.vocabulary import FAILURE, FINISHED, PENDING, RUNNING

__all__ = ["DAPO_FILTERED_REWARD_COUNTS_KEY", "Plan", "DrainState", "accumulate_metrics",
           "metrics_prefix", "classify"]

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
