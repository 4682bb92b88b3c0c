"""Sampling policies over the store: what a policy implements, and how the store tells them.

A policy (:mod:`buffer.steps`, :mod:`buffer.verl.groups`) keeps its own index of the keys it samples
from, updated under the store's lock for every key that changed. :class:`AttachedPolicies` tells them in
the order attached, and contains a policy that raises: a bug in one fails the store's waits instead of the
receiver thread.
"""

from __future__ import annotations

import logging
from itertools import compress
from operator import and_, eq, itemgetter, methodcaller, not_
from typing import Any, Mapping, Protocol, Sequence

from poller.wire.vocabulary import Tags

__all__ = ["AttachedPolicies", "BulkPolicy", "Policy", "positions_that_differ"]

logger = logging.getLogger(__name__)


class Policy(Protocol):
    """Sampling semantics over a :class:`~buffer.partitions.PartitionStore`: indexes kept from changes."""

    def on_change(self, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        """Called with the store lock held after one key changed (old None: added; new None: dropped).
        Must be cheap, must not call back into the store, must not mutate the dicts."""


class BulkPolicy(Policy, Protocol):
    """A policy that can also take many keys' changes in one call (each method optional): a poll's
    thousands of changed keys then cost a few C-level passes instead of a Python call each."""

    def on_added(self, partition_id: str, keys: list[str], tags: list[Tags]) -> None:
        """:meth:`Policy.on_change` with ``old=None`` for each of ``keys`` in order."""

    def on_replaced(self, partition_id: str, keys: list[str], olds: list[Tags], news: list[Tags]) -> None:
        """:meth:`Policy.on_change` for each of ``keys``, held before."""


class AttachedPolicies:
    """The policies attached to one store, told of each change (under its lock) in the order attached;
    ``failure`` is the first error a policy raised, which the store raises to its waiters."""

    def __init__(self) -> None:
        self._policies: list[Policy] = []
        self.failure: RuntimeError | None = None

    def __bool__(self) -> bool:
        return bool(self._policies)

    def append(self, policy: Policy) -> None:
        self._policies.append(policy)

    def changed(self, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        for policy in self._policies:
            self._tell(policy, partition_id, key, old, new)

    def added(self, partition_id: str, keys: list[str], tags: list[Tags]) -> None:
        self._bulk("on_added", (tags,), partition_id, keys, [None] * len(keys), tags)

    def replaced(self, partition_id: str, keys: list[str], olds: list[Tags], news: list[Tags]) -> None:
        self._bulk("on_replaced", (olds, news), partition_id, keys, olds, news)

    def _bulk(self, method: str, arguments: tuple[list[Tags], ...], partition_id: str, keys: list[str],
              olds: Sequence[Tags | None], news: list[Tags]) -> None:
        """``method(partition_id, keys, *arguments)`` of each policy that has it (:class:`BulkPolicy`), else
        ``on_change`` key by key."""
        if not keys:
            return
        for policy in self._policies:
            in_bulk = getattr(policy, method, None)
            if in_bulk is None:
                for key, old, new in zip(keys, olds, news):
                    self._tell(policy, partition_id, key, old, new)
                continue
            try:
                in_bulk(partition_id, keys, *arguments)
            except Exception as exc:
                self._failed(policy, partition_id, keys[0], exc)

    def _tell(self, policy: Policy, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        try:
            policy.on_change(partition_id, key, old, new)
        except Exception as exc:
            self._failed(policy, partition_id, key, exc)

    def _failed(self, policy: Policy, partition_id: str, key: str, exc: Exception) -> None:
        logger.error("policy %r failed on %r/%r", policy, partition_id, key, exc_info=exc)
        error = RuntimeError(f"sampling policy {type(policy).__name__} failed: {exc!r}")
        error.__cause__ = exc
        self.failure = self.failure or error


def positions_that_differ(olds: Sequence[Mapping[str, Any]], news: Sequence[Mapping[str, Any]],
                          names: Sequence[str]) -> Sequence[int]:
    """The positions whose old and new tags differ in any of the tags ``names`` (a tag absent reads ``None``).

    In C-level passes (~0.15 us a key); a value whose ``==`` is not a plain bool puts every position in.
    """
    positions = range(len(olds))
    try:
        try:  # every tag present (the usual case): one tuple each
            read = itemgetter(*names)
            return list(compress(positions, map(not_, map(eq, map(read, olds), map(read, news)))))
        except KeyError:
            same = [True] * len(olds)
            for name in names:
                get = methodcaller("get", name)
                same = list(map(and_, same, map(bool, map(eq, map(get, olds), map(get, news)))))
            return list(compress(positions, map(not_, same)))
    except Exception:
        return positions
