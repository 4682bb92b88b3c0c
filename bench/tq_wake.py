"""The host side of the TransferQueue wake-up line: finished → ``sample()`` returns, for both samplers.

Runs in :mod:`bench.tq_host`'s process (Ray and TransferQueue live, the
store holding K keys). Each sample: the trainer puts a prompt of step 1 as
``running`` (as verl's trainer puts a step's prompts), calls
``sample(1, "train", 1)`` in a thread, and a rollout (here, the host's
main thread) puts the prompt's two successful trajectories and its
``finished`` tag in one ``kv_batch_put`` a uniform 0.5–2.5 s after the call;
the figure is the time from that put's return to ``sample()``'s return.
Then the trainer clears the trajectories, as it does after its step, and
"trains" for :data:`TRAIN_STEP` seconds before the next call.

Both samplers live for the whole section, as verl builds them (trainer mode
``colocate_async``, threshold ``None``, no ``sampler_kwargs``), and take
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
from typing import Any, Callable

from .tq_host import _CALL_TIMEOUT, _HEARTBEAT_LAG, PARTITION, _CountingTQ, _empty

#: Seconds the trainer trains between two calls (no sampler call is in progress).
TRAIN_STEP = 0.5
#: Samples of one sampler in a row before the other takes its turn.
BLOCK = 5
#: The finished put comes this long after the call, uniformly.
DELAY = (0.5, 2.5)


class _Sampler:
    """One sampler under test: ``sample()``, its listings so far (and how late that count may be), ``close()``."""

    def __init__(self, name: str, sample: Callable[[], Any], listings: Callable[[], int], lag: float,
                 close: Callable[[], Any], reads: Callable[[], int] = lambda: 0) -> None:
        self.name = name
        self.sample = sample
        self.listings = listings
        self.reads = reads
        self.lag = lag
        self.close = close


def _product() -> _Sampler:
    from buffer.verl import ReplayBuffer

    sampler = ReplayBuffer(trainer_mode="colocate_async", trainer_config=_empty(), max_off_policy_threshold=None,
                           max_off_policy_strategy="drop", sampler_kwargs=_empty(), refill_fn=None)
    sampler.get_sampleable_count(1, PARTITION)  # started, its first listing applied
    return _Sampler("b", lambda: sampler.sample(1, PARTITION, 1), lambda: int(sampler.stats()["listings"]),
                    _HEARTBEAT_LAG, sampler.close, lambda: int(sampler.stats().get("watch_reads", 0)))


def _verl() -> tuple[_Sampler, Callable[[], None]]:
    import verl.trainer.ppo.v1.replay_buffer as module
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    original = module.tq
    counting = _CountingTQ(original)

    def restore() -> None:
        module.tq = original

    module.tq = counting
    sampler = ReplayBufferAsync(trainer_mode="colocate_async", trainer_config=_empty(), max_off_policy_threshold=None,
                                max_off_policy_strategy="drop", sampler_kwargs=_empty(), refill_fn=None)
    return _Sampler("c", lambda: sampler.sample(1, PARTITION, 1), lambda: counting.listings, 0.0,
                    lambda: None), restore


def one_sample(sampler: _Sampler, uid: str, rng: random.Random) -> dict[str, float]:
    """One wake-up of ``sampler``: the call, the finished put, the return; its group handed out and cleared."""
    import transfer_queue as tq

    tq.kv_put(key=uid, partition_id=PARTITION, tag={"is_prompt": True, "status": "running", "global_steps": 1})
    outcome: list[Any] = []
    returned: list[float] = []

    def call() -> None:
        try:
            outcome.append(sampler.sample())
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
        raise TimeoutError(f"{sampler.name}: sample() did not return {_CALL_TIMEOUT:g} s after {uid} finished")
    result = outcome[0]
    if isinstance(result, BaseException):
        raise RuntimeError(f"{sampler.name}: sample() raised") from result
    batch, _ = result
    if sorted(batch.keys) != sorted(trajectories + [uid]) and sorted(batch.keys) != sorted(trajectories):
        raise RuntimeError(f"{sampler.name}: sample() handed out {batch.keys}, not the group {uid}")
    tq.kv_clear(keys=trajectories, partition_id=PARTITION)
    return {"latency": returned[0] - finished, "after_call": finished - called}


def run(k: int, per_sampler: int, with_verl: bool,
        progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """``per_sampler`` wake-ups of each sampler at K=``k``, in blocks; one record per block."""
    samplers = [_product()]
    restore: Callable[[], None] | None = None
    try:
        if with_verl:
            verl, restore = _verl()
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
                    samples.append(one_sample(sampler, f"w{k}x{seq:06d}", delays[sampler.name]))
                    time.sleep(TRAIN_STEP)
                ended = time.monotonic()
                time.sleep(sampler.lag)  # the count catches up with the block's last listing
                records.append({"k": k, "sampler": sampler.name, "block": block, "seconds": ended - began,
                                "listings": sampler.listings() - listings0, "reads": sampler.reads() - reads0,
                                "latencies": [s["latency"] for s in samples]})
                progress(f"tq: K={k:,} wake-up block {block + 1}/{blocks} {sampler.name}: p50 "
                         f"{sorted(s['latency'] for s in samples)[len(samples) // 2]:.2f} s")
        return records
    finally:
        for sampler in samplers:
            sampler.close()
        if restore is not None:
            restore()
