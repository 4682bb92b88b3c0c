"""The host side of the TransferQueue wake-up line: finished → the call returns, for both samplers.

Runs in :mod:`bench.tq_host`'s process (Ray and TransferQueue live, the
store holding K keys). Each sample: the trainer puts a prompt of step 1 as
``running`` (as verl's trainer puts a step's prompts), makes the call of a
kind (:data:`KINDS`) in a thread, and a rollout (here, the host's
main thread) puts the prompt's two successful trajectories and its
``finished`` tag in one ``kv_batch_put`` a uniform 0.5–2.5 s after the call;
the figure is the time from that put's return to the call's return.
Then the trainer takes the group (``wait_for_sampleable`` consumes
nothing: a ``sample()`` follows it, as verl's hybrid switch trains on what
it waited for), clears the trajectories, as it does after its step, and
"trains" for :data:`TRAIN_STEP` seconds before the next call.

Per kind, both samplers live for the kind's whole line, as verl builds them
(the kind's trainer mode, threshold ``None``, no ``sampler_kwargs``), and take
turns in blocks of :data:`BLOCK` samples, the order swapped each round, so a
drift of the machine's load falls on both, and each draws the same seeded
delays in the same order. Each block also counts the
sampler's listings of the store (verl's ``tq.kv_list()`` calls at its call
site; buffer.verl's ``stats()["listings"]``, read once its heartbeat caught up)
and its targeted reads, if any, over the block's wall time.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable, NamedTuple

from .tq_host import _CALL_TIMEOUT, _HEARTBEAT_LAG, PARTITION, _CountingTQ, _empty

#: Seconds the trainer trains between two calls (no sampler call is in progress).
TRAIN_STEP = 0.5
#: Samples of one sampler in a row before the other takes its turn.
BLOCK = 5
#: The finished put comes this long after the call, uniformly.
DELAY = (0.5, 2.5)
#: The calls timed, by kind: verl's trainer mode for it, and the call.
KINDS = {
    "sample": "ReplayBufferAsync.sample(1, 'train', 1), trainer mode colocate_async",
    "wait": "ReplayBufferAsync.wait_for_sampleable(1, 'train', 1), trainer mode separate_async (verl's hybrid "
            "switch waits so before it trains; a sample(1, 'train', 1) then takes the group, untimed)",
    "sync": "ReplayBuffer.sample(1, 'train', 1), trainer mode sync (verl's synchronous sampler: hands out terminal "
            "groups, waits on no running prompt)",
}
_MODES = {"sample": "colocate_async", "wait": "separate_async", "sync": "sync"}


class _Sampler(NamedTuple):
    """One sampler under test: the call timed, what then takes the group (None: the call did, it was a
    ``sample()``), its listings and targeted reads so far (and how late those counts may be), ``close()``."""

    name: str
    call: Callable[[], Any]
    take: Callable[[], Any] | None
    listings: Callable[[], int]
    lag: float
    close: Callable[[], Any]
    reads: Callable[[], int] = lambda: 0


def _calls(sampler: Any, kind: str) -> tuple[Callable[[], Any], Callable[[], Any] | None]:
    """The call of ``kind`` on ``sampler`` and what then takes the group (None: the call took it)."""
    def sample() -> Any:
        return sampler.sample(1, PARTITION, 1)

    if kind == "wait":
        return lambda: sampler.wait_for_sampleable(1, PARTITION, 1), sample
    return sample, None


def _product(kind: str) -> _Sampler:
    from buffer.verl import ReplayBuffer

    sampler = ReplayBuffer(trainer_mode=_MODES[kind], trainer_config=_empty(), max_off_policy_threshold=None,
                           max_off_policy_strategy="drop", sampler_kwargs=_empty(), refill_fn=None)
    sampler.get_sampleable_count(1, PARTITION)  # started, its first listing applied
    return _Sampler("b", *_calls(sampler, kind), lambda: int(sampler.stats()["listings"]),
                    _HEARTBEAT_LAG, sampler.close, lambda: int(sampler.stats().get("watch_reads", 0)))


def _verl(kind: str) -> tuple[_Sampler, Callable[[], None]]:
    """verl 0.9.1's sampler for ``kind`` as its trainer builds its own: ``ReplayBufferAsync`` with six keywords,
    or for ``sync`` ``ReplayBuffer`` with what the trainer adds at ``data.train_batch_size=1`` (no filter)."""
    import verl.trainer.ppo.v1.replay_buffer as module
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    original = module.tq
    counting = _CountingTQ(original)

    def restore() -> None:
        module.tq = original

    module.tq = counting
    try:
        common = {"trainer_mode": _MODES[kind], "trainer_config": _empty(), "max_off_policy_threshold": None,
                  "max_off_policy_strategy": "drop", "sampler_kwargs": _empty(), "refill_fn": None}
        if kind == "sync":
            sampler = ReplayBuffer(**common, filter_groups_metric=None, sync_refill_failed_groups=False,
                                   train_batch_size=1, gen_batch_size=1, max_inflight_gen_batches=1)
        else:
            sampler = ReplayBufferAsync(**common)
    except BaseException:
        restore()
        raise
    return _Sampler("c", *_calls(sampler, kind), lambda: counting.listings, 0.0, lambda: None), restore


def one_sample(sampler: _Sampler, uid: str, rng: random.Random) -> dict[str, float]:
    """One wake-up of ``sampler``: the call, the finished put, the return; its group handed out and cleared.

    Raises:
        RuntimeError: the call raised, or did not hand out (or find sampleable) the group ``uid``.
        TimeoutError: the call did not return within the host's call deadline after ``uid`` finished.
    """
    import transfer_queue as tq

    tq.kv_put(key=uid, partition_id=PARTITION, tag={"is_prompt": True, "status": "running", "global_steps": 1})
    outcome: list[Any] = []
    returned: list[float] = []

    def call() -> None:
        try:
            outcome.append(sampler.call())
        except BaseException as exc:  # checked below, in the host's thread
            outcome.append(exc)
        returned.append(time.monotonic())

    thread = threading.Thread(target=call, name="bench-tq-wake", daemon=True)
    called = time.monotonic()
    thread.start()
    time.sleep(max(0.0, called + rng.uniform(*DELAY) - time.monotonic()))
    trajectories = [f"{uid}_0_0", f"{uid}_1_0"]
    tq.kv_batch_put(keys=trajectories + [uid], partition_id=PARTITION,
                    tags=[{"global_steps": 1, "status": "success", "reward": 1.0}] * 2
                    + [{"is_prompt": True, "status": "finished", "global_steps": 1}])
    finished = time.monotonic()
    thread.join(_CALL_TIMEOUT)
    if thread.is_alive():
        raise TimeoutError(f"{sampler.name}: the call did not return {_CALL_TIMEOUT:g} s after {uid} finished")
    result = outcome[0]
    if isinstance(result, BaseException):
        raise RuntimeError(f"{sampler.name}: the call raised") from result
    if sampler.take is not None:
        sampleable, _ = result
        if set(sampleable) != {uid}:
            raise RuntimeError(f"{sampler.name}: wait_for_sampleable() found {sorted(sampleable)}, not {uid}")
        result = sampler.take()
    batch, _ = result
    if sorted(batch.keys) != sorted(trajectories + [uid]) and sorted(batch.keys) != sorted(trajectories):
        raise RuntimeError(f"{sampler.name}: sample() handed out {batch.keys}, not the group {uid}")
    tq.kv_clear(keys=trajectories, partition_id=PARTITION)
    return {"latency": returned[0] - finished, "after_call": finished - called}


def run(k: int, per_sampler: int, with_verl: bool, kinds: tuple[str, ...],
        progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """``per_sampler`` wake-ups of each sampler at K=``k`` per kind of call, in blocks; one record per block."""
    records: list[dict[str, Any]] = []
    for kind in kinds:
        records += _kind(k, kind, per_sampler, with_verl, progress)
    return records


def _kind(k: int, kind: str, per_sampler: int, with_verl: bool,
          progress: Callable[[str], None]) -> list[dict[str, Any]]:
    samplers = [_product(kind)]
    restore: Callable[[], None] | None = None
    try:
        if with_verl:
            verl, restore = _verl(kind)
            samplers.append(verl)
        # The same seeded delays for each sampler, in the same order: the i-th wake-up of one is paired with
        # the i-th of the other (10 samples drawn at random fell 4 times out of 5 past one sampler's next listing).
        delays = {sampler.name: random.Random(k) for sampler in samplers}
        blocks = -(-per_sampler // BLOCK)
        records: list[dict[str, Any]] = []
        seq = 0
        for block in range(blocks):
            order = samplers if block % 2 == 0 else samplers[::-1]
            for sampler in order:
                count = min(BLOCK, per_sampler - block * BLOCK)
                listings0, reads0, began = sampler.listings(), sampler.reads(), time.monotonic()
                samples = []
                for _ in range(count):
                    seq += 1
                    samples.append(one_sample(sampler, f"w{k}{kind}x{seq:06d}", delays[sampler.name]))
                    time.sleep(TRAIN_STEP)
                ended = time.monotonic()
                time.sleep(sampler.lag)  # the count catches up with the block's last listing
                records.append({"k": k, "kind": kind, "sampler": sampler.name, "block": block,
                                "seconds": ended - began, "listings": sampler.listings() - listings0,
                                "reads": sampler.reads() - reads0, "latencies": [s["latency"] for s in samples]})
                progress(f"tq: K={k:,} {kind} wake-up block {block + 1}/{blocks} {sampler.name}: p50 "
                         f"{sorted(s['latency'] for s in samples)[len(samples) // 2]:.2f} s")
        return records
    finally:
        for sampler in samplers:
            sampler.close()
        if restore is not None:
            restore()
