"""The host side of the TransferQueue wake-up lines: finished → the call returns, for both samplers.

Runs in :mod:`bench.tq_host`'s process (Ray and TransferQueue live, the
store holding K keys). Two lines share it: the one-cadence line of
``--only tq`` (:func:`run`) and the family of ``--only wake-family``
(:func:`run_family`, tables in :mod:`bench.wake_family`).

::

    trainer (host main thread)        the call (a thread)           rollout (host main thread)
    │                                                              ├─ puts the prompt as running,
    │                                                              │  `lead` s before the call
    ├─ the call ─────────────────▶    sample / wait / sync         │
    │                                 ...                          ├─ `delay` s after the call: one
    │                                 returns ◀── the figure ──    │  kv_batch_put, 2 trajectories
    │                                 (wait: a sample() takes)     │  and the prompt `finished`
    ├─ trains `train` s, clears the trajectories (or not)
    └─ the next call

A *block* is one sampler's turn: a warm-up wake-up first (untimed: its
group finished before the call, so the first timed call follows one made a
train step before it, as every call of a trainer does), then the timed
wake-ups, then (the family) a pause that lets what the last call set off
end inside the block. Both samplers are built as verl builds them (the
kind's trainer mode, threshold ``None``, no ``sampler_kwargs``), live
together for a kind's whole line, and take turns in blocks, the order
swapped each round; each runs the same seeded wake-ups (leads and delays)
in the same order.

Where the lead is longer than the train step, the prompt goes in during an
earlier call, as an asynchronous trainer's rollouts run ahead of it: the
rollout puts it at the call's predicted time less the lead. The prediction
counts each wake-up still to come at its delay, its train step and the
fastest rest of a cycle (return, take, clear) this sampler showed in its
last :data:`_HISTORY` wake-ups, so the prediction is early rather than late
and a lead comes out at its nominal value or a little longer, seldom
shorter; each wake-up records its actual lead. A block starts its warm-up
late enough for its first prompts to be put a whole lead ahead.

In the family the host also reads the TransferQueue controller's CPU as
each call begins and at the block's end (:class:`bench.tq_host.ControllerCpu`:
the threads that serve requests): a wake-up's CPU is the controller's from
its call to the next call (its wait, its take, the train step and the
trainer's clear, with whatever prompts the rollout put meanwhile); and the
whole process's over each block. Per block it counts the sampler's
listings of the store (verl's ``tq.kv_list()`` calls at its call site;
buffer.verl's ``stats()["listings"]``) and targeted reads, until the
sampler's next block begins: neither sampler lists between its calls on
TransferQueue, so that is the block's own work, read long after its
heartbeat caught up.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from .tq_host import _CALL_TIMEOUT, _HEARTBEAT_LAG, PARTITION, ControllerCpu, _CountingTQ, _empty

#: Seconds the trainer trains between two calls in the one-cadence line (no sampler call is in progress).
TRAIN_STEP = 0.5
#: Wake-ups of one sampler in a row before the other takes its turn, in the one-cadence line.
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
#: The family's blocks end this long after the last call's train step began (less the step, at least 0): what
#: that call set off (a listing under way, the watch's last reads) ends inside the block, so the controller's CPU
#: it costs is the block's own.
SETTLE = 3.0
#: How many of a sampler's last wake-ups its predictions draw on.
_HISTORY = 10
#: The longest the block's loop sleeps between two looks at its deadlines.
_TICK = 1.0


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


@dataclass
class WakeUp:
    """One planned wake-up: the prompt's uid; its lead (s the prompt is put as running before the call);
    its delay (s after the call the group finishes; None: a warm-up, finished before the call); the train
    step after its group is taken; whether the trainer then clears the group's trajectories; and labels its
    record carries (the cell it belongs to)."""

    uid: str
    lead: float
    delay: float | None
    train: float
    clears: bool
    labels: dict[str, Any] = field(default_factory=dict)

    @property
    def trajectories(self) -> list[str]:
        return [f"{self.uid}_0_0", f"{self.uid}_1_0"]


def predicted_calls(wakeups: Sequence[WakeUp], start: int, first: float, rest: float) -> list[float]:
    """When the calls of ``wakeups[start:]`` should begin, the first at ``first``: each next one a delay, a
    train step and ``rest`` (the return, the take and the clear after the finish) after the one before."""
    times = [first]
    for wakeup in wakeups[start:-1]:
        times.append(times[-1] + (wakeup.delay or 0.0) + rest + wakeup.train)
    return times


def lead_room(wakeups: Sequence[WakeUp], rest: float) -> float:
    """How long before its first call a block must begin for each prompt to be put a whole lead ahead."""
    times = predicted_calls(wakeups, 0, 0.0, rest)
    return max([0.0] + [w.lead - t for w, t in zip(wakeups, times) if w.delay is not None])


class _Call:
    """One wake-up's call in a thread of its own (the trainer's), then its take; what it gave, and when."""

    def __init__(self, sampler: _Sampler) -> None:
        self._sampler = sampler
        self.done = threading.Event()
        self.result: Any = None
        self.sampleable: set[str] | None = None
        self.error: BaseException | None = None
        self.returned = 0.0
        self.taken = 0.0
        self._thread = threading.Thread(target=self._run, name="bench-tq-wake", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            result = self._sampler.call()
            self.returned = time.monotonic()
            if self._sampler.take is not None:
                sampleable, _ = result
                self.sampleable = set(sampleable)
                result = self._sampler.take()
            self.result = result
        except BaseException as exc:  # checked in the host's thread
            self.error = exc
            self.returned = self.returned or time.monotonic()
        finally:
            self.taken = time.monotonic()
            self.done.set()

    def check(self, name: str, wakeup: WakeUp) -> None:
        """Raises RuntimeError: the call raised, or did not hand out (or find sampleable) the group."""
        if self.error is not None:
            raise RuntimeError(f"{name}: the call raised") from self.error
        if self.sampleable is not None and self.sampleable != {wakeup.uid}:
            raise RuntimeError(f"{name}: wait_for_sampleable() found {sorted(self.sampleable)}, not {wakeup.uid}")
        batch, _ = self.result
        group = sorted(wakeup.trajectories + [wakeup.uid])
        if sorted(batch.keys) not in (group, sorted(wakeup.trajectories)):
            raise RuntimeError(f"{name}: sample() handed out {batch.keys}, not the group {wakeup.uid}")


def _no_cpu() -> float:
    return 0.0


def run_block(sampler: _Sampler, wakeups: Sequence[WakeUp], *, cpu_of: Callable[[], float] = _no_cpu,
              settle: float = 0.0, history: list[float]) -> list[dict[str, Any]]:
    """One block of ``sampler``: ``wakeups`` in order (warm-ups have no delay), then ``settle`` s; a record per
    wake-up, with ``cpu_of()`` (the controller's CPU seconds so far) from its call to the next call.
    ``history``: the sampler's rest of a cycle (return, take, clear after the finish) so far, carried over its
    blocks; the predictions draw on its fastest recent value (0 at first).

    Raises:
        RuntimeError: a call raised, or did not hand out (or find sampleable) its group.
        TimeoutError: a call did not return within the host's call deadline after its group finished.
    """
    import transfer_queue as tq

    def rest() -> float:
        return min(history[-_HISTORY:]) if history else 0.0

    n = len(wakeups)
    put: list[float | None] = [None] * n
    called: list[float] = [0.0] * n
    finished: list[float | None] = [None] * n
    cpu: list[float] = [0.0] * n
    calls: list[_Call | None] = [None] * n
    unput = {i for i, w in enumerate(wakeups) if w.delay is not None}
    ready = time.monotonic() + lead_room(wakeups, rest())
    j = 0  # the wake-up whose call is next, or in progress
    call: _Call | None = None

    def put_due(times: list[float], start: int, now: float) -> list[float]:
        """Put every prompt due by ``now``; the due times of those still to put."""
        later = []
        for i in sorted(unput):
            if i < start:
                continue
            due = times[i - start] - wakeups[i].lead
            if due <= now:
                tq.kv_put(key=wakeups[i].uid, partition_id=PARTITION,
                          tag={"is_prompt": True, "status": "running", "global_steps": 1})
                put[i] = time.monotonic()
                unput.discard(i)
            else:
                later.append(due)
        return later

    while True:
        now = time.monotonic()
        if call is not None and call.done.is_set():
            call.check(sampler.name, wakeups[j])
            ready = call.taken + wakeups[j].train
            j, call = j + 1, None
            continue
        wake = []
        if call is not None:
            wakeup = wakeups[j]
            if wakeup.delay is not None and finished[j] is None:
                if now >= called[j] + wakeup.delay:
                    tq.kv_batch_put(keys=wakeup.trajectories + [wakeup.uid], partition_id=PARTITION,
                                    tags=[{"global_steps": 1, "status": "success", "reward": 1.0}] * 2
                                    + [{"is_prompt": True, "status": "finished", "global_steps": 1}])
                    finished[j] = time.monotonic()
                    continue
                wake.append(called[j] + wakeup.delay)
            finish = finished[j]
            if wakeup.delay is None or finish is not None:
                if now - (finish if finish is not None else called[j]) > _CALL_TIMEOUT:
                    raise TimeoutError(f"{sampler.name}: the call did not return {_CALL_TIMEOUT:g} s after "
                                       f"{wakeup.uid} finished")
            returns = max(now, called[j] + (wakeup.delay or 0.0)) + rest()
            wake += put_due(predicted_calls(wakeups, j + 1, returns + wakeup.train, rest()), j + 1, now)
        elif now >= ready:
            if j > 0 and wakeups[j - 1].clears:
                tq.kv_clear(keys=wakeups[j - 1].trajectories, partition_id=PARTITION)
            if j == n:
                break
            # The call is now: every prompt due by then goes in, this call's own among them (after the clear, as
            # a trainer submits a step's prompts after it cleared the last batch); one due later than predicted
            # goes in now, its lead short of the nominal (its record shows it).
            now = time.monotonic()
            put_due(predicted_calls(wakeups, j, now, rest()), j, now)
            wakeup = wakeups[j]
            if wakeup.delay is None:  # the warm-up: its group finished before the call
                tq.kv_batch_put(keys=wakeup.trajectories + [wakeup.uid], partition_id=PARTITION,
                                tags=[{"global_steps": 1, "status": "success", "reward": 1.0}] * 2
                                + [{"is_prompt": True, "status": "finished", "global_steps": 1}])
                put[j] = time.monotonic()
            if j > 0:
                before = wakeups[j - 1]
                history.append(time.monotonic() - (finished[j - 1] or called[j - 1]) - before.train)
            cpu[j] = cpu_of()
            called[j] = time.monotonic()
            call = calls[j] = _Call(sampler)
            continue
        else:
            wake.append(ready)
            wake += put_due(predicted_calls(wakeups, j, ready, rest()), j, now)
        timeout = max(0.0, min([t - now for t in wake] + [_TICK]))
        if call is not None:
            call.done.wait(timeout)
        else:
            time.sleep(timeout)
    time.sleep(settle)
    end_cpu, ended = cpu_of(), time.monotonic()
    records = []
    for i, wakeup in enumerate(wakeups):
        done = calls[i]
        assert done is not None
        next_cpu, next_call = (cpu[i + 1], called[i + 1]) if i + 1 < n else (end_cpu, ended)
        record: dict[str, Any] = {
            **wakeup.labels, "uid": wakeup.uid, "warm": wakeup.delay is None, "lead": wakeup.lead,
            "delay": wakeup.delay, "train": wakeup.train, "clears": wakeup.clears,
            "called": called[i], "lead_actual": called[i] - (put[i] or called[i]),
            "cpu": next_cpu - cpu[i], "window": next_call - called[i],
        }
        if wakeup.delay is not None:
            finish = finished[i]
            assert finish is not None
            record.update(latency=done.returned - finish, after_call=finish - called[i])
        records.append(record)
    leftovers = [key for w in wakeups if not w.clears for key in w.trajectories]
    if leftovers:  # the next block begins with the store as this one did: K keys
        tq.kv_clear(keys=leftovers, partition_id=PARTITION)
    return records


@dataclass
class Turn:
    """One round of the samplers' turns: the same wake-ups (leads and delays) for each, as ``(lead, delay)``
    pairs; the train step and the clears of the whole block; the labels its records carry; the pause at its
    end."""

    pairs: list[tuple[float, float]]
    train: float
    clears: bool
    labels: dict[str, Any]
    settle: float = 0.0


def take_turns(samplers: Sequence[_Sampler], turns: Iterable[Turn], *, prefix: str,
               emit: Callable[[dict[str, Any]], None], progress: Callable[[str], None],
               cpu_of: Callable[[], float] = _no_cpu, process_cpu: Callable[[], float] = _no_cpu,
               extra: dict[str, Any] | None = None) -> None:
    """Each turn's block for each sampler, the order swapped each turn; ``emit`` gets one record per block
    (``latencies``, ``seconds``, ``listings``, ``reads``, ``wakeups``, ``process_cpu`` over the block, the
    labels, ``extra``) once its counts are read: when the same sampler's next block begins, or a heartbeat
    after the last. ``cpu_of``: the controller's CPU per wake-up (:func:`run_block`); ``process_cpu``: its
    whole process's, per block.

    A block's wake-ups are a warm-up and then the turn's pairs; their uids are ``prefix``, the sampler's name
    and a sequence number, unique over the host's run.
    """
    history: dict[str, list[float]] = {sampler.name: [] for sampler in samplers}
    pending: dict[str, tuple[dict[str, Any], int, int]] = {}
    seq = 0

    def counted(sampler: _Sampler) -> None:
        if sampler.name in pending:
            record, listings, reads = pending.pop(sampler.name)
            emit({**record, "listings": sampler.listings() - listings, "reads": sampler.reads() - reads})

    for number, turn in enumerate(turns):
        order = list(samplers) if number % 2 == 0 else list(samplers)[::-1]
        for sampler in order:
            counted(sampler)
            wakeups = []
            for lead, delay in [(0.0, None)] + list(turn.pairs):
                seq += 1
                wakeups.append(WakeUp(f"{prefix}{sampler.name}{seq:06d}", lead, delay, turn.train, turn.clears,
                                      dict(turn.labels)))
            listings, reads, process, began = sampler.listings(), sampler.reads(), process_cpu(), time.monotonic()
            records = run_block(sampler, wakeups, cpu_of=cpu_of, settle=turn.settle, history=history[sampler.name])
            latencies = [r["latency"] for r in records if not r["warm"]]
            pending[sampler.name] = ({**turn.labels, **(extra or {}), "sampler": sampler.name, "block": number,
                                      "train": turn.train, "clears": turn.clears,
                                      "seconds": time.monotonic() - began, "calls": len(records),
                                      "process_cpu": process_cpu() - process,
                                      "load": os.getloadavg()[0], "latencies": latencies, "wakeups": records},
                                     listings, reads)
            progress(f"{' '.join(f'{k}={v}' for k, v in turn.labels.items())} train {turn.train:g} s "
                     f"clears {'yes' if turn.clears else 'no'}, turn {number + 1}, {sampler.name}: p50 "
                     f"{sorted(latencies)[len(latencies) // 2]:.2f} s over {len(latencies)}, "
                     f"{time.monotonic() - began:.0f} s")
    time.sleep(max((sampler.lag for sampler in samplers), default=0.0))  # the counts catch up with the last
    for sampler in samplers:
        counted(sampler)


def _both(kind: str, with_verl: bool) -> tuple[list[_Sampler], Callable[[], None]]:
    """The samplers of ``kind`` (buffer.verl, and verl's if asked) and what closes them."""
    samplers = [_product(kind)]
    restore: Callable[[], None] | None = None

    def close() -> None:
        for sampler in samplers:
            sampler.close()
        if restore is not None:
            restore()

    try:
        if with_verl:
            verl, restore = _verl(kind)
            samplers.append(verl)
    except BaseException:
        close()
        raise
    return samplers, close


def run(k: int, per_sampler: int, with_verl: bool, kinds: tuple[str, ...],
        progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """The one-cadence line: ``per_sampler`` wake-ups of each sampler at K=``k`` per kind of call, a lead of 0,
    a :data:`TRAIN_STEP` train step and the trainer's clears, in blocks of :data:`BLOCK`; one record per block."""
    records: list[dict[str, Any]] = []
    for kind in kinds:
        # The same seeded delays for each sampler, in the same order: the i-th wake-up of one is paired with
        # the i-th of the other (10 samples drawn at random fell 4 times out of 5 past one sampler's next listing).
        rng = random.Random(k)
        delays = [rng.uniform(*DELAY) for _ in range(per_sampler)]
        turns = [Turn([(0.0, d) for d in delays[start:start + BLOCK]], TRAIN_STEP, True, {"k": k, "kind": kind})
                 for start in range(0, per_sampler, BLOCK)]
        samplers, close = _both(kind, with_verl)
        try:
            take_turns(samplers, turns, prefix=f"w{k}{kind}", emit=records.append,
                       progress=lambda text: progress(f"tq: {text}"))
        finally:
            close()
    return records


def family_turns(k: int, kind: str, trains: Sequence[float], leads: Sequence[float], clears: Sequence[bool],
                 reps: int, settle: float = SETTLE) -> list[Turn]:
    """The family's turns at K=``k`` for ``kind``: one per (clears, train step), each holding ``reps`` wake-ups
    of every lead. Seeded by the turn: the same for both samplers and from run to run.

    Each lead's ``reps`` delays are drawn one from each of ``reps`` equal slices of :data:`DELAY` (uniform
    over all, and each cell's delays spread over the range: with 2-3 wake-ups a cell, a plain draw often puts
    them all at one end). The wake-ups come in ``reps`` rounds of every lead, the first round's leads
    ascending (so the block need not begin a whole long lead ahead), the others shuffled.
    """
    out = []
    low, high = DELAY
    for clear in clears:
        for train in trains:
            rng = random.Random(f"{k}/{kind}/{clear}/{train:g}")
            delays: dict[float, list[float]] = {}
            for lead in leads:
                spread = [low + (s + rng.random()) * (high - low) / reps for s in range(reps)]
                rng.shuffle(spread)
                delays[lead] = spread
            rounds = [sorted(leads)] + [rng.sample(list(leads), len(leads)) for _ in range(reps - 1)]
            pairs = [(lead, delays[lead][r]) for r, order in enumerate(rounds) for lead in order]
            out.append(Turn(pairs, train, clear, {"k": k, "kind": kind}, max(0.0, settle - train)))
    return out


def run_family(k: int, plan: Any, meter: ControllerCpu, emit: Callable[[dict[str, Any]], None],
               progress: Callable[[str], None]) -> None:
    """The family at K=``k`` (``plan``: a :class:`bench.wake_family.FamilyPlan`): per kind, both samplers
    alive for the kind's turns (:func:`family_turns`); one record per block to ``emit``, each wake-up's CPU
    that of the controller's serving threads, the block's that of its whole process, with their idle rates."""
    extra = {"idle": meter.idle_threads, "idle_process": meter.idle_process, "threads": len(meter.threads)}
    for kind in plan.kinds:
        samplers, close = _both(kind, True)
        try:
            take_turns(samplers, family_turns(k, kind, plan.trains, plan.leads, plan.clears, plan.reps),
                       prefix=f"f{k}{kind}", emit=emit, progress=lambda text: progress(f"wake-family: {text}"),
                       cpu_of=meter.serving, process_cpu=meter.process, extra=extra)
        finally:
            close()
