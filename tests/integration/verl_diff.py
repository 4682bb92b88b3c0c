"""verl 0.9.1's installed sampler and buffer.verl's, driven through the same calls on the same store states.

Runs inside the store host. For each seed: a sampler configuration, then
steps of "the rollout writes, then the trainer decides". Each decision runs
on verl's ``ReplayBuffer`` / ``ReplayBufferAsync`` first; the store is put
back to the state before it; the same decision runs on ours; the outcomes
are compared (:mod:`tests.integration.verl_compare`); the store goes on from
verl's outcome. Nothing is timed: a wait is a wait on a state, ended by a
scripted write (:func:`~tests.integration.verl_world.unblock`).

verl sleeps between polls in ``_wait_for_next_poll``: the subclass here
applies the next unblocking write there instead of sleeping, so the number
of waits verl needed is exact. Ours waits on a change: it gets the same
writes, each once it has looked at the state before it.
"""

from __future__ import annotations

import random
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from tests.helpers.verl import verls
from tests.integration.verl_world import PARTITIONS, Refill, World, unblock

#: Waits verl may need in one decision before the scenario gives up on it.
MAX_UNBLOCKS = 4
#: How long ours gets to look at a state verl waited on before the next unblocking write.
_GRACE = 0.3
_OUR_TIMEOUT = 30.0


class StillWaiting(Exception):
    """verl still waited after :data:`MAX_UNBLOCKS` unblocking writes."""


@dataclass
class Outcome:
    """What one decision did, as the comparator sees it."""

    kind: str
    batch: dict[str, dict[str, Any]] | None = None  # key -> tags
    batch_order: list[str] = field(default_factory=list)
    count: int | None = None
    sampleable: set[str] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    refill_calls: list[int] = field(default_factory=list)
    cleared: dict[str, set[str]] = field(default_factory=dict)
    waits: int = 0


def config_for(seed: int) -> dict[str, Any]:
    """The seed's sampler keywords, as verl 0.9.1's _build_replay_buffer passes them to its own classes."""
    rng = random.Random(f"config-{seed}")
    mode = rng.choice(("sync", "colocate_async", "separate_async"))
    threshold = rng.choice((None, 1, 2, 3))
    strategy = rng.choice(("drop", "wait"))
    metric = rng.choice((None, "acc", "reward"))
    kwargs: dict[str, Any] = {"trainer_mode": mode, "trainer_config": {}, "max_off_policy_threshold": threshold,
                              "max_off_policy_strategy": strategy, "filter_groups_metric": metric,
                              "sync_refill_failed_groups": False}
    if mode == "sync":
        refill_failed = rng.random() < 0.4
        train_batch_size = rng.choice((1, 2, 3))
        kwargs.update(sync_refill_failed_groups=refill_failed, train_batch_size=train_batch_size,
                      gen_batch_size=1 if metric is not None or refill_failed else train_batch_size,
                      max_inflight_gen_batches=rng.choice((1, 2)) if metric is not None else 1)
    return kwargs


def verl_sampler(kwargs: dict[str, Any], refill: Callable[[int], Any], on_wait: Callable[[], None]) -> Any:
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    base = ReplayBuffer if kwargs["trainer_mode"] == "sync" else ReplayBufferAsync

    class Stepped(base):  # type: ignore[misc, valid-type]
        def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
            on_wait()  # instead of time.sleep(poll_interval): the next scripted write, or StillWaiting
            return last_debug_time

    return Stepped(**kwargs, sampler_kwargs={}, refill_fn=refill)


def our_sampler(kwargs: dict[str, Any], refill: Callable[[int], Any]) -> Any:
    from buffer.verl import ReplayBuffer

    # No listing share: it only delays decisions (every decision here syncs first), and thousands of them
    # at ~70 listings' time apart would not fit the test's time; the share has its own tests.
    return ReplayBuffer(**kwargs, refill_fn=refill,
                        sampler_kwargs={"poll_interval": 0.02, "sample_timeout": _OUR_TIMEOUT,
                                        "listing_share": 1.0})


class Forward:
    """The refill_fn a sampler is built with; each decision points it at that decision's Refill."""

    def __init__(self) -> None:
        self.target: Callable[[int], Any] | None = None

    def __call__(self, n: int) -> Any:
        assert self.target is not None, "refill_fn called outside a decision"
        return self.target(n)


@dataclass
class Call:
    kind: str  # sample, get_sampleable_count, wait_for_sampleable
    pid: str
    global_steps: int
    size: int


def _invoke(sampler: Any, call: Call) -> Any:
    if call.kind == "sample":
        return sampler.sample(global_steps=call.global_steps, partition_id=call.pid, batch_size=call.size)
    if call.kind == "get_sampleable_count":
        return sampler.get_sampleable_count(call.global_steps, call.pid)
    return sampler.wait_for_sampleable(call.global_steps, call.pid, call.size)


def _record(outcome: Outcome, call: Call, result: Any) -> None:
    if call.kind == "sample":
        batch, metrics = result
        outcome.batch = {key: dict(tag) for key, tag in zip(batch.keys, batch.tags)}
        outcome.batch_order = list(batch.keys)
        # buffer.verl's own figures of the call (sampler/...) are added beside verl's: compared, verl's.
        outcome.metrics = verls(metrics)
    elif call.kind == "get_sampleable_count":
        outcome.count = int(result)
    else:
        sampleable, metrics = result
        outcome.sampleable, outcome.metrics = set(sampleable), verls(metrics)


def _cleared(world: World, before: dict[str, set[str]]) -> dict[str, set[str]]:
    """Keys there before the decision or written during it, and gone after it."""
    listed = world.listing()
    return {pid: (before[pid] | set(world.model[pid])) - set(listed[pid]) for pid in PARTITIONS}


def decide_verl(world: World, sampler: Any, forward: Forward, waits: dict[str, Any], call: Call,
                tag: tuple[int, ...]) -> Outcome:
    outcome = Outcome(call.kind)
    refill = Refill(world, call.pid, call.global_steps, (*tag, "refill"))
    forward.target = refill
    before = {pid: set(world.model[pid]) for pid in PARTITIONS}

    def on_wait() -> None:
        if outcome.waits >= MAX_UNBLOCKS:
            raise StillWaiting(f"verl still waits after {MAX_UNBLOCKS} unblocking writes")
        unblock(world, call.pid, call.global_steps, call.size, (*tag, "unblock", outcome.waits))
        outcome.waits += 1

    waits["on_wait"] = on_wait
    try:
        _record(outcome, call, _invoke(sampler, call))
    except Exception as exc:  # compared: same type and message on both sides
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        waits["on_wait"] = None
        forward.target = None
    outcome.refill_calls = refill.calls
    outcome.cleared = _cleared(world, before)
    return outcome


def decide_ours(world: World, sampler: Any, forward: Forward, call: Call, tag: tuple[int, ...],
                verl_waits: int) -> Outcome:
    outcome = Outcome(call.kind)
    refill = Refill(world, call.pid, call.global_steps, (*tag, "refill"))
    forward.target = refill
    before = {pid: set(world.model[pid]) for pid in PARTITIONS}
    # The state was just written: the decision must look at a listing that began after it.
    sampler._store.start(call.pid).sync(10.0)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = _invoke(sampler, call)
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=run, name="ours-decision", daemon=True)
    worker.start()
    try:
        for _ in range(verl_waits):
            worker.join(_GRACE)
            if not worker.is_alive():
                break  # ours did not wait where verl did: the comparator sees the fewer waits
            unblock(world, call.pid, call.global_steps, call.size, (*tag, "unblock", outcome.waits))
            outcome.waits += 1
        worker.join(_OUR_TIMEOUT + 10)
        if worker.is_alive():
            raise RuntimeError(f"our sampler's {call.kind} did not return within its sample_timeout")
    finally:
        forward.target = None
    if "error" in box:
        exc = box["error"]
        outcome.error = f"{type(exc).__name__}: {exc}"
    else:
        _record(outcome, call, box["result"])
    outcome.refill_calls = refill.calls
    outcome.cleared = _cleared(world, before)
    return outcome


def next_call(kwargs: dict[str, Any], rng: random.Random, global_steps: int) -> Call:
    pid = "val" if rng.random() < 0.2 else "train"
    if kwargs["trainer_mode"] == "sync":
        return Call("sample", pid, global_steps, kwargs["train_batch_size"] if pid == "train" else rng.choice((1, 2)))
    kind = rng.choices(("sample", "get_sampleable_count", "wait_for_sampleable"), (0.7, 0.15, 0.15))[0]
    return Call(kind, pid, global_steps, rng.choice((1, 2, 3)))


def crash_text() -> str:
    return traceback.format_exc(limit=8)
