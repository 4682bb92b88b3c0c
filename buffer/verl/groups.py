"""verl's prompt groups, indexed from the store's changes.

verl writes two kinds of keys into one partition::

    {uid}                  the prompt: {"is_prompt": True, "status": ..., "global_steps": g}
    {uid}_{session}_{i}    its trajectories (any tags; "status": "success")

A prompt's ``status`` moves pending -> running -> finished | failure; a
group (the prompt and its trajectories) is *terminal* once its prompt is
finished or failure. :class:`GroupIndex`, a store policy, is told every key
that changed under the store's lock and updates only what that key touches.
Prompts are bucketed per status by ``global_steps``, so the rules
(:mod:`.rules`) touch only the buckets they need. Each partition's *version*
moves exactly when what the rules read in it changes: a waiting decision is
re-run only on a new one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain, islice
from typing import Any

from buffer.policies import positions_that_differ
from poller.wire.vocabulary import FAILURE, FINISHED, PENDING, PROMPT_STATUSES, RUNNING, Tags

__all__ = ["GroupIndex", "GroupPartition", "uid_of"]

#: What of a prompt's tags its group depends on; a trajectory's tags never move a group.
_GROUP_TAGS = ("is_prompt", "status", "global_steps")


def uid_of(key: str) -> str:
    """The group a key belongs to: the part before the first ``_`` (verl's rule)."""
    return key.partition("_")[0]


class GroupPartition:
    """The groups of one partition. Read it with the store lock held."""

    __slots__ = ("status", "step", "buckets", "trajectories", "invalid", "unclassified", "filtered")

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
        if not (part.status or part.trajectories or part.invalid):
            del self._parts[partition_id]
            del self._versions[partition_id]

    def on_replaced(self, partition_id: str, keys: list[str], olds: list[Tags], news: list[Tags]) -> None:
        """:meth:`on_change` of each key held before; those whose group tags kept their values changed no group."""
        for i in positions_that_differ(olds, news, _GROUP_TAGS):
            self.on_change(partition_id, keys[i], olds[i], news[i])

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
