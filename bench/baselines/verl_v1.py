"""verl's v1 sampler (``verl/trainer/ppo/v1/replay_buffer.py``), modelled for the benchmark.

What it does, and what this model keeps:

* ``sample()`` runs in the trainer's thread. Each round it calls ``kv_list()``
  on the store, then clears and rebuilds all of its state from the full
  listing: a merged dict of trajectory tags per partition, sets of prompt
  uids per status, and each prompt's ``global_steps``.
* Terminal groups (``finished`` or ``failure`` prompts) minus evicted ones are
  sampleable; with too few, it sleeps ``poll_interval`` and starts over. It
  never gives up.
* Selection takes the oldest prompts first, clears the selected prompt keys
  in the store, and collects the selected groups' trajectories by scanning
  the whole partition.

Left out, as the benchmark's workload never reaches them: DAPO filtering,
refill, the ``wait`` strategy and the periodic log line. Async ``drop`` and
failure eviction are modelled (clear the groups, poll again).
"""

from __future__ import annotations

import time
from typing import Any, Callable

Tags = dict[str, Any]


class VerlV1Sampler:
    """The poll-and-rebuild loop of verl v1's ``ReplayBuffer.sample``, async mode."""

    def __init__(self, kv_list: Callable[[], Any], kv_clear: Callable[[list[str], str], None], *,
                 poll_interval: float = 2.0, max_off_policy_threshold: int = 1_000_000) -> None:
        self._kv_list = kv_list
        self._kv_clear = kv_clear
        self.poll_interval = poll_interval
        self.max_off_policy_threshold = max_off_policy_threshold
        self.polls = 0
        self.partitions: dict[str, dict[str, Tags]] = {}
        self.status_keys: dict[str, dict[str, set[str]]] = {}
        self.prompt_global_steps: dict[str, dict[str, int]] = {}

    def _rebuild(self) -> None:
        # verl clears everything and rebuilds from the full listing, every poll.
        self.partitions.clear()
        self.status_keys.clear()
        self.prompt_global_steps.clear()
        data = self._kv_list()
        self.polls += 1
        if data is None:
            return
        for partition_id, items in data.items():
            partition = self.partitions.setdefault(partition_id, {})
            statuses = self.status_keys.setdefault(
                partition_id, {"pending": set(), "running": set(), "finished": set(), "failure": set()})
            steps = self.prompt_global_steps.setdefault(partition_id, {})
            for key, tag in items.items():
                if tag.get("is_prompt", False):
                    steps[key] = tag["global_steps"]
                    status = tag["status"]
                    if status not in statuses:
                        raise ValueError(f"Unknown status: {status}")
                    statuses[status].add(key)
                else:
                    if key not in partition:
                        partition[key] = {}
                    partition[key].update(tag)

    def _evicted(self, global_steps: int, partition_id: str) -> set[str]:
        if partition_id == "val":
            return set()
        statuses = self.status_keys.get(partition_id, {})
        steps = self.prompt_global_steps.get(partition_id, {})
        stale = {uid for uid in statuses.get("finished", ())
                 if global_steps - steps.get(uid, global_steps) + 1 > self.max_off_policy_threshold}
        return stale | set(statuses.get("failure", ()))

    def _clear_groups(self, partition_id: str, uids: set[str]) -> None:
        partition = self.partitions.get(partition_id, {})
        self._kv_clear(list(uids) + [key for key in partition if key.split("_")[0] in uids], partition_id)

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[list[str], list[Tags]]:
        """Wait for ``batch_size`` terminal groups; return their trajectories' keys and tags."""
        while True:
            self._rebuild()
            evicted = self._evicted(global_steps, partition_id)
            if evicted:
                self._clear_groups(partition_id, evicted)
                continue
            statuses = self.status_keys.get(partition_id, {})
            terminal = statuses.get("finished", set()) | statuses.get("failure", set())
            if len(terminal) >= batch_size:
                steps = dict(self.prompt_global_steps.get(partition_id, {}))
                snapshot = dict(self.partitions.get(partition_id, {}))
                selected = sorted(terminal, key=lambda uid: steps.get(uid, 0))[:batch_size]
                break
            time.sleep(self.poll_interval)
        self._kv_clear(selected, partition_id)
        chosen = set(selected)
        keys, tags = [], []
        for key, tag in snapshot.items():
            if key.split("_")[0] in chosen:
                keys.append(key)
                tags.append(tag)
        return keys, tags

    def close(self) -> None:
        """verl's sampler has no close(); nothing runs between calls."""
