"""A seeded world of verl's agent loop on a real TransferQueue, for the differential test.

Runs inside the store host (where TransferQueue is live). :class:`World`
writes the way verl's trainer and agent loop do and keeps a model of what it
wrote, so that a store state can be restored exactly: the differential test
runs verl's sampler and ours one after the other on the same state.

* the trainer submits prompts as ``pending`` (tags only, one batch put);
* the agent loop marks a prompt ``running``, writes each session's
  trajectory (tags, ``extra_fields.reward_extra_info`` and ``rm_scores``),
  sometimes one early, then the prompt's terminal status, ``finished`` or
  ``failure`` (a failure may have no trajectory at all);
* ``refill_fn`` writes whole groups synchronously, before it returns;
* after a sample the trainer clears the batch's trajectories.

Every value written is a plain Python value (tags) or a float tensor
(``rm_scores``), drawn from one ``random.Random`` per purpose; in every
third seed the numbers in tags (``global_steps``, ``seq_len``) are numpy
scalars instead, as rollout workers often write them: verl's sampler reads
them in-process, ours as the poller converts them on its way.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

PARTITIONS = ("train", "val")
#: Reward values are multiples of 1/4: sums and means are exact in float32 and float64 alike.
_ACC = (0.0, 1.0)
_SCORES = (0.0, 0.25, 0.5, 1.0)
_TOKENS = 4


@dataclass
class Entry:
    """One stored key: its merged tags and, for a trajectory, its two DAPO fields."""

    tags: dict[str, Any]
    acc: float | None = None
    rm: list[float] | None = None


Model = dict[str, dict[str, Entry]]


class World:
    """The store as the scenario wrote it (``model``), and the writes that keep store and model equal."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.model: Model = {pid: {} for pid in PARTITIONS}
        self.counter = 0
        self.writes = 0
        self.numpy_numbers = seed % 3 == 0

    def number(self, value: int) -> Any:
        """``value`` as this seed writes numbers in tags: an int, or a numpy int64."""
        if not self.numpy_numbers:
            return value
        import numpy

        return numpy.int64(value)

    # -- raw writes ----------------------------------------------------------------------------

    def new_uid(self) -> str:
        # No "_" in a uid: verl splits trajectory keys "{uid}_{session}_{index}" on it.
        self.counter += 1
        return f"s{self.seed}u{self.counter}"

    def put(self, pid: str, key: str, tags: dict[str, Any], acc: float | None = None,
            rm: list[float] | None = None) -> None:
        import torch
        import transfer_queue as tq

        fields = None
        if rm is not None:
            fields = {"rm_scores": torch.tensor(rm, dtype=torch.float32),
                      "extra_fields": {"reward_extra_info": {"acc": acc}}}
        tq.kv_put(key=key, partition_id=pid, fields=fields, tag=dict(tags))
        entry = self.model[pid].setdefault(key, Entry({}))
        entry.tags.update(tags)
        if rm is not None:
            entry.acc, entry.rm = acc, list(rm)
        self.writes += 1

    def submit(self, pid: str, uids: list[str], step: int) -> None:
        """verl's _submit_batch_to_rollout: pending prompts, tags only, one call."""
        import transfer_queue as tq

        tags = [{"is_prompt": True, "status": "pending", "global_steps": self.number(step)} for _ in uids]
        tq.kv_batch_put(keys=uids, partition_id=pid, tags=[dict(t) for t in tags])
        for uid, tag in zip(uids, tags):
            self.model[pid][uid] = Entry(tag)
        self.writes += 1

    def clear(self, pid: str, keys: list[str]) -> None:
        import transfer_queue as tq

        if keys:
            tq.kv_clear(keys=keys, partition_id=pid)
        for key in keys:
            self.model[pid].pop(key, None)

    def listing(self) -> dict[str, dict[str, dict[str, Any]]]:
        import transfer_queue as tq

        listed = tq.kv_list() or {}
        return {pid: dict(listed.get(pid, {})) for pid in PARTITIONS}

    def restore(self, target: Model) -> None:
        """Make the store (and the model) exactly ``target``: clear extra keys, put missing or changed ones."""
        current = self.listing()
        for pid in PARTITIONS:
            extra = sorted(set(current[pid]) - set(target[pid]))
            if extra:
                self.clear(pid, extra)
            for key, entry in target[pid].items():
                if current[pid].get(key) != entry.tags or key not in self.model[pid]:
                    self.put(pid, key, entry.tags, entry.acc, entry.rm)
        self.model = copy.deepcopy(target)

    def snapshot(self) -> Model:
        return copy.deepcopy(self.model)

    # -- the agent loop ------------------------------------------------------------------------

    def prompts(self, pid: str, *statuses: str) -> list[str]:
        return sorted(key for key, entry in self.model[pid].items()
                      if entry.tags.get("is_prompt") and entry.tags.get("status") in statuses)

    def trajectories(self, pid: str, uid: str) -> list[str]:
        return sorted(key for key in self.model[pid] if key.split("_")[0] == uid and key != uid)

    def start(self, pid: str, uid: str) -> None:
        self.put(pid, uid, {"status": "running"})

    def write_trajectory(self, pid: str, uid: str, session: int, rng: random.Random, signal: bool = False) -> None:
        step = self.model[pid][uid].tags["global_steps"]
        acc = float(session % 2) if signal else rng.choice(_ACC)
        rm = [float(session)] + [0.0] * (_TOKENS - 1) if signal else [rng.choice(_SCORES) for _ in range(_TOKENS)]
        self.put(pid, f"{uid}_{session}_0", {"status": "success", "global_steps": self.number(step),
                                             "seq_len": self.number(_TOKENS)},
                 acc=acc, rm=rm)

    def finish(self, pid: str, uid: str, rng: random.Random, status: str, sessions: int,
               signal: bool = False) -> None:
        """The rest of the group's trajectories (those not written early), then the terminal status."""
        written = len(self.trajectories(pid, uid))
        for session in range(written, sessions):
            self.write_trajectory(pid, uid, session, rng, signal)
        self.put(pid, uid, {"status": status})

    def group(self, pid: str, step: int, rng: random.Random, status: str = "finished", sessions: int = 2,
              signal: bool = False) -> str:
        """One whole group, submitted and run to its end (refill_fn's and the unblocking writes)."""
        uid = self.new_uid()
        self.submit(pid, [uid], step)
        self.start(pid, uid)
        self.finish(pid, uid, rng, status, sessions, signal)
        return uid


def random_group_end(rng: random.Random) -> tuple[str, int]:
    """A terminal status and its number of trajectories: failures are sometimes empty."""
    if rng.random() < 0.25:
        return "failure", rng.choice((0, 0, 1, 2))
    return "finished", rng.choice((1, 2, 2, 3))


def advance(world: World, pid: str, step: int, rng: random.Random) -> None:
    """One round of the rollout: new prompts, pending ones start, running ones write or end."""
    fresh = [world.new_uid() for _ in range(rng.choice((0, 1, 2, 2, 3)))]
    if fresh:
        world.submit(pid, fresh, step)
    for uid in world.prompts(pid, "pending"):
        if uid not in fresh and rng.random() < 0.7:
            world.start(pid, uid)
    for uid in world.prompts(pid, "running"):
        roll = rng.random()
        if roll < 0.6:
            status, sessions = random_group_end(rng)
            world.finish(pid, uid, rng, status, sessions)
        elif roll < 0.8 and not world.trajectories(pid, uid):
            world.write_trajectory(pid, uid, 0, rng)  # one session ended early; the group runs on


class Refill:
    """refill_fn writing synchronously: ``n`` whole groups at the decision's step, content seeded per call."""

    def __init__(self, world: World, pid: str, step: int, seed: tuple[int, ...]) -> None:
        self.world, self.pid, self.step, self.seed = world, pid, step, seed
        self.calls: list[int] = []

    def __call__(self, n: int) -> int:
        rng = random.Random(str((*self.seed, len(self.calls))))
        self.calls.append(n)
        for _ in range(n):
            status, sessions = ("failure", 0) if rng.random() < 0.15 else ("finished", rng.choice((1, 2, 3)))
            self.world.group(self.pid, self.step, rng, status, sessions)
        return n


def unblock(world: World, pid: str, step: int, batch_size: int, seed: tuple[int, ...]) -> None:
    """What ends a wait: every prompt in flight finishes (with signal); with none in flight, fresh groups do.

    The prompts turn terminal together, in one ``kv_batch_put`` of their tags:
    a sampler that wakes on every change (ours) must not decide on a state
    with only some of them done, which verl (asleep meanwhile) never sees.
    Everything written before that (running marks, trajectories) leaves
    every group in flight, which can only hold a decision back.
    """
    import transfer_queue as tq

    rng = random.Random(str(seed))
    inflight = world.prompts(pid, "pending", "running")
    if not inflight:
        inflight = [world.new_uid() for _ in range(max(1, batch_size))]
        world.submit(pid, inflight, step)
    for uid in inflight:
        if world.model[pid][uid].tags["status"] == "pending":
            world.start(pid, uid)
        for session in range(len(world.trajectories(pid, uid)), 2):
            world.write_trajectory(pid, uid, session, rng, signal=True)
    tq.kv_batch_put(keys=inflight, partition_id=pid, tags=[{"status": "finished"} for _ in inflight])
    for uid in inflight:
        world.model[pid][uid].tags["status"] = "finished"
