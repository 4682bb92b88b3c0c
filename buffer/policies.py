"""Sampling policies over the store: what a policy implements, and how the store tells them.

A policy (:mod:`buffer.steps` for ``ReplayBuffer.sample``, :mod:`buffer.groups`
for verl's groups) keeps its own index of the keys it samples from, updated
from :meth:`Policy.on_change`, which the :class:`~buffer.partitions.PartitionStore`
calls under its lock for every key that changed. :class:`AttachedPolicies` is
how the store makes those calls: in the order the policies were attached, the
keys a snapshot adds in one call to a policy that takes them so, and a policy
that raises contained, so a bug in one fails the store's waits instead of the
receiver thread.
"""

from __future__ import annotations

import logging
from typing import Protocol

from poller.vocabulary import Tags

__all__ = ["AttachedPolicies", "BulkPolicy", "Policy"]

logger = logging.getLogger(__name__)


class Policy(Protocol):
    """Sampling semantics over a :class:`~buffer.partitions.PartitionStore`: indexes kept from changes."""

    def on_change(self, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        """Called with the store lock held after one key changed (old None: added; new None: dropped).

        Must be cheap and must not call back into the store. Dicts must not be mutated.
        """


class BulkPolicy(Policy, Protocol):
    """A policy that can also take the keys a snapshot adds all at once (optional)."""

    def on_added(self, partition_id: str, keys: list[str], tags: list[Tags]) -> None:
        """Like :meth:`Policy.on_change` with ``old=None`` for each of ``keys`` in order, in one call."""


class AttachedPolicies:
    """The policies attached to one store, told of each change in the order they were attached.

    Called with the store's lock held. ``failure`` is the first error a
    policy raised (``None``: none did); the store raises it to its waiters.
    """

    def __init__(self) -> None:
        self._policies: list[Policy] = []
        self.failure: RuntimeError | None = None

    def __bool__(self) -> bool:
        return bool(self._policies)

    def append(self, policy: Policy) -> None:
        self._policies.append(policy)

    def changed(self, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        """Tell every policy that one key changed (see :meth:`Policy.on_change`)."""
        for policy in self._policies:
            self._tell(policy, partition_id, key, old, new)

    def added(self, partition_id: str, keys: list[str], tags: list[Tags]) -> None:
        """Tell every policy of keys new to the store, at once if it can take them so (a snapshot's thousands)."""
        if not keys:
            return
        for policy in self._policies:
            on_added = getattr(policy, "on_added", None)
            if on_added is None:
                for key, new in zip(keys, tags):
                    self._tell(policy, partition_id, key, None, new)
                continue
            try:
                on_added(partition_id, keys, tags)
            except Exception as exc:
                self._failed(policy, partition_id, keys[0], exc)

    def _tell(self, policy: Policy, partition_id: str, key: str, old: Tags | None, new: Tags | None) -> None:
        try:
            policy.on_change(partition_id, key, old, new)
        except Exception as exc:
            self._failed(policy, partition_id, key, exc)

    def _failed(self, policy: Policy, partition_id: str, key: str, exc: Exception) -> None:
        # A policy bug must not kill the receiver thread (which would leave
        # every wait hanging): it fails the store, and waiters see it.
        logger.error("policy %r failed on %r/%r", policy, partition_id, key, exc_info=exc)
        error = RuntimeError(f"sampling policy {type(policy).__name__} failed: {exc!r}")
        error.__cause__ = exc
        self.failure = self.failure or error
