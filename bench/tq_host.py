"""The host side of ``python -m bench --only tq``: runs in a process of its own, where TransferQueue is live.

::

    runner (bench.tq) ──spawn──▶ host: ray.init + tq.init (the trainer's process, as verl's TaskRunner)
         ▲                        │── preloads K keys into partition "train"
         │ pipe: progress,        │── Writer actor (a rollout worker): kv_batch_put of 16 keys, in a loop
         │       one record       │── phase a: nothing else
         │       per phase        │── phase b: buffer.verl blocked in sample() (its poller process lists)
         │                        │── phase c: verl 0.9.1's sampler blocked in sample() in a thread
         └────────────────────────┘── phase d: buffer.verl between calls (started, no call in progress)

Before the phases of each K, the controller's CPU per request is measured
with nothing else running (:func:`costs_alone`); after the minimum rounds,
a round is added while a slowdown interval is too wide to decide on
(:func:`more_rounds`, :func:`bench.tq.resolved`).

Each phase measures the writer (batches/s, put latency) and the CPU of the
TransferQueue controller's process, plus the CPU of whatever lists the store
for the sampler (buffer.verl's poller process, or the thread that runs verl's
``sample()``) and its listings, over a window of whole listing cycles inside
the writer's run (:func:`window`; phase a: the whole run). Nothing here is imported by the
runner process: Ray's threads and processes stay out of the other benchmarks.

``python -m bench --only wake-family`` runs in the same host (:func:`serve_family`): the same
store and preload (:func:`live_store`, :func:`preload`), no writer, the wake-up family of
:mod:`bench.tq_wake`, with the controller's CPU read from the threads that serve requests
(:class:`ControllerCpu`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator

PARTITION = "train"
BATCH_KEYS = 16  # one GRPO group of rollouts per put, as verl's agent loop finishes them
GROUP_KEYS = 16  # a preloaded group: its prompt key and 15 trajectories
WRITER_POOL = 64  # groups the writer cycles through, so K stays what was preloaded
NEVER = 1_000_000  # groups asked of sample(): more than will ever be terminal, so it waits the whole phase
_CALL_TIMEOUT = 120.0  # any single Ray or store call of the host
_SAMPLE_EVERY = 0.05  # seconds between the host's readings of the CPU and listing counters during a phase
# How late buffer.verl's stats()["listings"] may be: a heartbeat a second, the poller's 0.2 s tick, and a margin;
# below the 2 s pause between two listings, so the count read that long after a listing is done is its own.
_HEARTBEAT_LAG = 1.5
# Seconds before a listing's mark that hold its controller work: the listing (d) and what follows it up to the
# mark (the product's diff and send, p) and one sample; ~0.3 s at K=100k, short of the 2 s pause.
_AROUND = 1.0
#: Keys of one targeted read measured alone: a decision waiting on one prompt, and the watch's cap.
#: Keys per targeted read measured alone: one, and buffer.verl's most (buffer.verl.WATCHED_PROMPTS).
WATCH_KEYS = (1, 64)
#: A round of targeted reads measured alone runs until the controller spent this much CPU (10 ms ticks: ~3%)...
_READS_CPU = 0.3
#: ... or for this long, whichever comes first.
_READS_WALL = 5.0


class PhaseStopped(Exception):
    """Raised in verl's sampler thread when its phase ends."""


def cpu_seconds(stat: str) -> float:
    """utime + stime from a ``/proc/<pid>/stat`` or ``/proc/<pid>/task/<tid>/stat`` file."""
    with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Writer:
    """A rollout worker (a Ray actor, as verl's are): puts 16-key batches with ``tq.kv_batch_put`` in a loop.

    Each batch rewrites the trajectories of one of :data:`WRITER_POOL`
    preloaded groups with new tags (``global_steps``, ``status``, a reward) and
    small fields, so the store keeps its K keys while its tags keep changing.
    """

    def __init__(self, uids: list[str]) -> None:
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict

        tq.init()  # attaches to the running controller, as a rollout worker does
        self._uids = uids
        self._fields = TensorDict({"responses": torch.arange(BATCH_KEYS * 8).reshape(BATCH_KEYS, 8)},
                                  batch_size=[BATCH_KEYS])
        self._written = 0

    def run(self, seconds: float) -> dict[str, Any]:
        """Put batches for ``seconds``; returns the count, the loop's span and each put's start and latency.

        Times are ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every
        process of the machine), so the host can count the puts that fall in
        a window of its own.
        """
        import transfer_queue as tq

        latencies: list[float] = []
        starts: list[float] = []
        started = time.monotonic()
        end = started + seconds
        while time.monotonic() < end:
            uid = self._uids[self._written % len(self._uids)]
            step = 1 + self._written // len(self._uids)
            keys = [f"{uid}_{i}_0" for i in range(BATCH_KEYS)]
            tags = [{"global_steps": step, "status": "success", "reward": float((self._written + i) % 2)}
                    for i in range(BATCH_KEYS)]
            put = time.monotonic()
            tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=self._fields, tags=tags)
            latencies.append(time.monotonic() - put)
            starts.append(put)
            self._written += 1
        ended = time.monotonic()
        return {"began": started, "ended": ended, "batches": len(latencies), "seconds": ended - started,
                "latencies": latencies, "starts": starts}


def preload(start: int, stop: int) -> None:
    """Groups ``start .. stop-1`` (16 keys each, tags only): prompts ``running``, so nothing is ever sampleable."""
    import transfer_queue as tq

    for first in range(start, stop, 500):
        keys: list[str] = []
        tags: list[dict[str, Any]] = []
        for n in range(first, min(stop, first + 500)):
            uid = f"g{n:07d}"
            keys.append(uid)
            tags.append({"is_prompt": True, "status": "running", "global_steps": 0})
            for i in range(GROUP_KEYS - 1):
                keys.append(f"{uid}_{i}_0")
                tags.append({"global_steps": 0, "status": "success", "reward": 0.0})
        tq.kv_batch_put(keys=keys, partition_id=PARTITION, tags=tags)


class _Blocked:
    """A sampler's ``sample()`` blocked in a thread for one phase.

    ``listings()`` counts the sampler's full listings of the store so far,
    exactly but up to ``lag`` seconds late; ``marks()`` moves by one as each
    listing is done with, at once (the window's edges, :func:`window`);
    ``lister_cpu()`` adds up the CPU of the thread blocked in ``sample()``,
    of the process ``lister_stat`` names (the ``/proc`` stat file of a
    poller that lists the store for the sampler; None: none) and of the
    threads ``also`` names, which work for it in this process (the product's
    receiver and supervisor; TransferQueue's client, which decodes replies in
    a thread of its own); ``reads()`` counts the sampler's targeted reads
    (buffer.verl's watch), as late as ``listings()``; ``stop`` ends the phase,
    after which ``sample()`` must raise ``expected``; ``cleanup`` runs once
    the thread has ended.
    """

    def __init__(self, sample: Callable[[], Any], stop: Callable[[], Any], listings: Callable[[], int],
                 lister_stat: str | None, expected: type[BaseException], *,
                 marks: Callable[[], int] | None = None, lag: float = 0.0, also: tuple[str, ...] = (),
                 cleanup: Callable[[], Any] | None = None, reads: Callable[[], int] = lambda: 0) -> None:
        self._stop = stop
        self.listings = listings
        self.reads = reads
        self.marks = marks or listings
        self.lag = lag
        self._expected = expected
        self._cleanup = cleanup
        self._outcome: list[BaseException | None] = []
        self._thread = threading.Thread(target=self._run, args=(sample,), name="bench-tq-sample", daemon=True)
        self._thread.start()
        # native_id is set by the time start() returns.
        self._lister_stats = ((lister_stat,) if lister_stat else ()) + (
            f"/proc/self/task/{self._thread.native_id}/stat",) + also

    def _run(self, sample: Callable[[], Any]) -> None:
        try:
            sample()
            self._outcome.append(None)
        except BaseException as exc:  # the phase's end stops it with an exception; end() checks which
            self._outcome.append(exc)

    def lister_cpu(self) -> float:
        return sum(cpu_seconds(stat) for stat in self._lister_stats)

    def end(self) -> None:
        """Stop the sampler; its ``sample()`` must end with the expected exception within the deadline."""
        self._stop()
        self._thread.join(_CALL_TIMEOUT)
        if self._thread.is_alive():
            raise TimeoutError("sample() did not return after its phase ended")
        if self._cleanup is not None:
            self._cleanup()
        outcome = self._outcome[0]
        if not isinstance(outcome, self._expected):
            raise RuntimeError(f"sample() ended with {outcome!r}, not {self._expected.__name__}: "
                               "it must wait for the whole phase") from outcome


def _empty() -> Any:
    """An empty config section, as verl's trainer passes ``trainer_config`` and ``sampler_kwargs`` (OmegaConf)."""
    from omegaconf import OmegaConf

    return OmegaConf.create({})


def _product(between_calls: bool = False) -> _Blocked:
    """buffer.verl as a verl trainer builds it (six keywords, no sampler_kwargs), blocked in ``sample()``.

    Its listings are its poller's own count, ``stats()["listings"]``, as its
    last heartbeat said (one a second). The window's edges are its polls
    applied, ``stats()["polls"]``: a poll of TransferQueue (no change feed)
    is one listing, applied a few ms after its listing's diff is sent.

    With ``between_calls``, no call is in progress for the phase: after the
    call that starts it, a thread stands in for the blocked one and only
    waits for the phase's end, so what the poller does is what it does
    between verl's calls while the trainer trains (verl's own sampler runs
    no code then: it lists nothing).
    """
    from buffer.errors import BufferClosed
    from buffer.verl import ReplayBuffer

    before = {thread.native_id for thread in threading.enumerate()}
    sampler = ReplayBuffer(trainer_mode="colocate_async", trainer_config=_empty(), max_off_policy_threshold=None,
                           max_off_policy_strategy="drop", sampler_kwargs=_empty(), refill_fn=None)
    try:
        sampler.get_sampleable_count(1, PARTITION)  # starts the poller and waits for its first listing
        poller = sampler.stats()["poller_pid"]
        # Its threads in this process (they live until close): what it costs here, as verl's are counted.
        own = tuple(f"/proc/self/task/{thread.native_id}/stat" for thread in threading.enumerate()
                    if thread.native_id not in before)

        def blocked(sample: Callable[[], Any], stop: Callable[[], Any], expected: type[BaseException],
                    cleanup: Callable[[], Any] | None = None) -> _Blocked:
            return _Blocked(sample, stop, lambda: int(sampler.stats()["listings"]), f"/proc/{poller}/stat", expected,
                            marks=lambda: int(sampler.stats()["polls"]), lag=_HEARTBEAT_LAG, also=own,
                            cleanup=cleanup, reads=lambda: int(sampler.stats().get("watch_reads", 0)))

        if not between_calls:
            return blocked(lambda: sampler.sample(global_steps=1, partition_id=PARTITION, batch_size=NEVER),
                           sampler.close, BufferClosed)
        ended = threading.Event()

        def trains() -> None:
            ended.wait()
            raise PhaseStopped()

        return blocked(trains, ended.set, PhaseStopped, cleanup=sampler.close)
    except BaseException:
        sampler.close()
        raise


class _CountingTQ:
    """``transfer_queue`` as verl's sampler module sees it, counting each ``kv_list()`` call when it returns."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.listings = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def kv_list(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._module.kv_list(*args, **kwargs)
        finally:
            self.listings += 1


def _verl() -> _Blocked:
    """verl 0.9.1's own ``ReplayBufferAsync`` as its trainer builds it, blocked in ``sample()`` in a thread.

    verl's sampler never gives up; the subclass waits its ``poll_interval``
    on an event instead of ``time.sleep`` so the phase's end can stop it.
    Its listings are counted at the call site: the sampler module's ``tq``
    is wrapped for the phase, and each ``tq.kv_list()`` counts as it returns.
    Nothing else of verl's code changes. Its lister is the thread running
    ``sample()`` and the event-loop thread of TransferQueue's client, where
    ``kv_list()``'s request runs and its reply is decoded.
    """
    import transfer_queue as tq
    import verl.trainer.ppo.v1.replay_buffer as module
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    stop = threading.Event()
    original = module.tq
    counting = _CountingTQ(original)

    class Stoppable(ReplayBufferAsync):  # type: ignore[misc]
        def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
            if stop.wait(self.poll_interval):
                raise PhaseStopped()
            return last_debug_time

    def restore() -> None:
        module.tq = original

    module.tq = counting
    try:
        sampler = Stoppable(trainer_mode="colocate_async", trainer_config=_empty(), max_off_policy_threshold=None,
                            max_off_policy_strategy="drop", sampler_kwargs=_empty(), refill_fn=None)
        loop = getattr(tq.get_client(), "_thread", None)
        also = (f"/proc/self/task/{loop.native_id}/stat",) if loop is not None else ()
        return _Blocked(lambda: sampler.sample(global_steps=1, partition_id=PARTITION, batch_size=NEVER),
                        stop.set, lambda: counting.listings, None, PhaseStopped, also=also, cleanup=restore)
    except BaseException:
        restore()
        raise


SAMPLERS: dict[str, Callable[[], _Blocked] | None] = {"a": None, "b": _product, "c": _verl,
                                                       "d": lambda: _product(between_calls=True)}


#: The sample tuple: (monotonic, controller CPU s, lister CPU s, marks, listings).
Sample = tuple[float, float, float, int, int]


def window(samples: list[Sample], began: float, ended: float) -> tuple[int, int, bool]:
    """The measured window of a phase: indices ``(i, j)`` into ``samples`` and whether it is aligned.

    ``samples`` are taken every :data:`_SAMPLE_EVERY` s; only those within
    the writer's run ``[began, ended]`` count. With two or more listings done
    with in it (their marks), the window runs from the first sample that saw
    one to the last: it holds whole listing cycles, ``marks[j] - marks[i]``
    of them, each with its listing's controller work (a mark follows its
    listing's end by the sampler's processing, well within the 2 s pause
    before the next begins), so neither the count nor the CPU depends on
    where the run's edges fell. Otherwise (no sampler, or too few listings)
    it is the whole run.
    """
    inside = [n for n, sample in enumerate(samples) if began <= sample[0] <= ended]
    if len(inside) < 2:
        raise RuntimeError(f"{len(inside)} sample(s) within the writer's run: the host could not keep up")
    ends = [n for n in inside[1:] if samples[n][3] > samples[n - 1][3]]
    if len(ends) >= 2:
        return ends[0], ends[-1], True
    return inside[0], inside[-1], False


def _sample(blocked: _Blocked | None, controller: int) -> Sample:
    if blocked is None:
        return time.monotonic(), cpu_seconds(f"/proc/{controller}/stat"), 0.0, 0, 0
    marks, listings = blocked.marks(), blocked.listings()
    return time.monotonic(), cpu_seconds(f"/proc/{controller}/stat"), blocked.lister_cpu(), marks, listings


def around_listings(samples: list[Sample], i: int, j: int, starts: list[float]) -> tuple[float, int]:
    """The controller's CPU seconds and the puts begun in the spans that hold the window's listings.

    Each listing done with in the window ``(i, j]`` (its mark moved at
    sample ``m``) has its controller work within the :data:`_AROUND` seconds
    before that sample. Against the rest of the window, a second or so
    away in the same phase, these spans show what a listing costs the
    controller beyond the puts, whatever the machine's load did between phases.
    """
    cpu, batches = 0.0, 0
    for m in range(i + 1, j + 1):
        if samples[m][3] > samples[m - 1][3]:
            first = next(n for n in range(i, m + 1) if samples[n][0] >= samples[m][0] - _AROUND)
            cpu += samples[m][1] - samples[first][1]
            batches += sum(1 for t in starts if samples[first][0] < t <= samples[m][0])
    return cpu, batches


def _counted(samples: list[Sample], when: float) -> int:
    """The listings count of the first sample taken at or after ``when``."""
    return next(sample[4] for sample in samples if sample[0] >= when)


def _phase(name: str, writer: Any, controller: int, seconds: float) -> dict[str, Any]:
    """One phase: the sampler of ``name`` (if any) blocked, the writer running ``seconds``; the figures.

    Rates are over the phase's :func:`window`: the writer's puts that began
    in it, the controller's and the lister's CPU, the listings done with in
    it. Those listings are also counted by the sampler's own count (read once
    it has caught up with the window's edges): ``counted``.
    """
    import ray

    make = SAMPLERS[name]
    blocked = make() if make is not None else None
    try:
        time.sleep(0.2)  # into its wait loop (verl's first listing may still run: it lists all phase anyway)
        samples = [_sample(blocked, controller)]
        reads0 = blocked.reads() if blocked is not None else 0
        run = writer.run.remote(seconds)
        deadline = time.monotonic() + seconds + _CALL_TIMEOUT
        while not ray.wait([run], timeout=_SAMPLE_EVERY)[0]:
            samples.append(_sample(blocked, controller))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the writer did not end within {seconds + _CALL_TIMEOUT:g} s")
        samples.append(_sample(blocked, controller))
        out = ray.get(run, timeout=_CALL_TIMEOUT)
        i, j, aligned = window(samples, out["began"], out["ended"])
        if blocked is not None:
            while samples[-1][0] < samples[j][0] + blocked.lag:  # until the count has caught up with the end
                time.sleep(_SAMPLE_EVERY)
                samples.append(_sample(blocked, controller))
            reads1 = blocked.reads()
    finally:
        if blocked is not None:
            blocked.end()
    (t0, cpu0, lister0, marks0, _), (t1, cpu1, lister1, marks1, _) = samples[i], samples[j]
    wall = t1 - t0
    starts = out.pop("starts")
    record = {
        "phase": name,
        "seconds": wall,
        "batches": sum(1 for t in starts if t0 < t <= t1),
        "latencies": out["latencies"],
        "run_seconds": out["seconds"],
        "controller_cpu": (cpu1 - cpu0) / wall,
        "lister_cpu": None,
        "listings": None,
        "counted": None,
        "aligned": aligned,
        "around_cpu": None,
        "around_batches": None,
        "reads": None,
        "reads_seconds": None,
    }
    if blocked is not None:
        lag = blocked.lag
        around_cpu, around_batches = around_listings(samples, i, j, starts)
        record.update(lister_cpu=(lister1 - lister0) / wall, listings=marks1 - marks0,
                      counted=_counted(samples, t1 + lag) - _counted(samples, t0 + lag),
                      around_cpu=around_cpu, around_batches=around_batches,
                      # Both counts lag the reads by up to a heartbeat: over the whole phase that is a few %.
                      reads=reads1 - reads0, reads_seconds=samples[-1][0] - samples[0][0])
    return record


def costs_alone(controller: int, k: int, rounds: int, prompts: list[str]) -> dict[str, Any]:
    """The controller's CPU seconds per request with no writer and no sampler, per round.

    ``{"listings": {"b": [...], "c": [...]}, "reads": {1: [...], 64: [...]}}``.
    Listings: ``b``, the request ``buffer.verl``'s poller sends (its
    TransferQueue source, partition ``train``); ``c``, verl's sampler's,
    ``tq.kv_list()`` (every partition). Reads: the targeted read of
    ``buffer.verl``'s watch, ``kv_watch("train", keys)`` (one
    ``KV_RETRIEVE_META``), for the first 1 and 64 of ``prompts``
    (:data:`WATCH_KEYS`); when the source has no ``kv_watch``, ``reads`` is
    the reason instead. The requests alternate, each round running enough
    of them for the controller's CPU to be read to a few per cent (``/proc``
    counts 10 ms ticks); its idle CPU, read first, is taken off. Nothing but
    the request differs, so this is what one request of each costs the
    shared controller, free of the writer's noise that the in-phase
    estimate carries.
    """
    import transfer_queue as tq

    from poller.sources import transferqueue as tq_source

    stat = f"/proc/{controller}/stat"
    source = tq_source.TransferQueueSource(**tq_source.source_kwargs(partition_ids=[PARTITION]))
    try:
        listing: dict[str, Callable[[], Any]] = {"b": source.kv_list_packed, "c": tq.kv_list}
        # A source from before buffer.verl's watch has no kv_watch: its reads are then not measured.
        watch: Callable[[str, list[str]], bytes] | None = getattr(source, "kv_watch", None)
        reads = {n: _read(watch, prompts[:n]) for n in WATCH_KEYS} if watch is not None else {}
        why_not = "" if watch is not None else \
            "not measured: this TransferQueue source has no kv_watch (buffer.verl's watch is not in it)"
        for request in [*listing.values(), *reads.values()]:
            request()  # connected and warm
        listings = max(8, 800_000 // k)  # ~0.3 s of the controller's CPU a round at any K
        before, began = cpu_seconds(stat), time.monotonic()
        time.sleep(1.0)
        idle = (cpu_seconds(stat) - before) / (time.monotonic() - began)
        costs: dict[str, list[float]] = {name: [] for name in listing}
        read_costs: dict[int, list[float]] = {n: [] for n in reads}
        for r in range(rounds):
            for name in list(listing) if r % 2 == 0 else list(listing)[::-1]:
                costs[name].append(_cost_per_request(stat, listing[name], idle, count=listings))
            for n in list(reads) if r % 2 == 0 else list(reads)[::-1]:
                read_costs[n].append(_cost_per_request(stat, reads[n], idle, cpu=_READS_CPU, wall=_READS_WALL))
        return {"listings": costs, "reads": read_costs if reads else why_not}
    finally:
        source.close()


def _read(watch: Callable[[str, list[str]], bytes], keys: list[str]) -> Callable[[], bytes]:
    """One targeted read of ``keys`` in partition ``train``, as buffer.verl's watch makes it."""
    return lambda: watch(PARTITION, keys)


def _cost_per_request(stat: str, request: Callable[[], Any], idle: float, *, count: int | None = None,
                      cpu: float = 0.0, wall: float = 0.0) -> float:
    """The controller's CPU seconds per ``request``, its ``idle`` CPU per second taken off: over ``count``
    requests, or (without ``count``) until it spent ``cpu`` seconds or ``wall`` seconds passed."""
    before, began = cpu_seconds(stat), time.monotonic()
    done = 0
    while True:
        request()
        done += 1
        if count is not None:
            if done >= count:
                break
        elif done % 20 == 0 and (cpu_seconds(stat) - before >= cpu or time.monotonic() - began >= wall):
            break
    spent = cpu_seconds(stat) - before - idle * (time.monotonic() - began)
    return spent / done


def schedule(phases: str, rounds: int) -> list[tuple[int, str]]:
    """The phases of one K in the order they run: ``(round, phase)``.

    Every sampler phase runs between two of phase a, whose mean is its
    reference (:func:`bench.tq.bracketed`): the writer's rate drifts by
    10% and more from one 15 s phase to the next on a loaded 2-core machine
    (and in either direction over a run), and a reference measured on both
    sides of a phase cancels a steady drift, where one measured before or
    after it (a rotated order) counts the drift as the sampler's cost. The
    samplers swap places each round, so neither always follows the other.
    """
    samplers = [name for name in phases if name != "a"]
    order: list[tuple[int, str]] = []
    for r in range(rounds):
        for name in samplers if r % 2 == 0 else samplers[::-1]:
            order += [(r, "a"), (r, name)]
    return order + [(rounds - 1, "a")]


def more_rounds(phases: str, done: int) -> list[tuple[int, str]]:
    """The phases that extend :func:`schedule` ``(phases, done)`` by one round: what follows its closing
    phase a (which opens the new round) in ``schedule(phases, done + 1)``."""
    return schedule(phases, done + 1)[len(schedule(phases, done)):]


def _controller_pid() -> int:
    import ray

    controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    pid: Any = ray.get(controller.__ray_call__.remote(lambda actor: os.getpid()), timeout=_CALL_TIMEOUT)
    return int(pid)


@contextlib.contextmanager
def live_store(conn: Connection, with_verl: bool) -> Iterator[int]:
    """Ray and TransferQueue started in this process, as verl's TaskRunner has them (and verl's sampler
    module imported, with ``with_verl``); yields the controller actor's pid. Stops them on the way out.

    The product's restarts and escalations and verl's INFO lines are noise here, as in the runner; the
    host says where it imports ``buffer`` from (a worktree's run must measure that worktree's product).
    """
    # Ray's socket paths must fit in 108 bytes: a short directory under /tmp.
    temp_dir = tempfile.mkdtemp(prefix="bench-tq-", dir="/tmp")
    started_store = False
    try:
        from examples.verl_style_trainer import start_store

        conn.send(("progress", "tq: starting Ray and TransferQueue"))
        start_store(temp_dir=temp_dir)
        started_store = True
        if with_verl:
            conn.send(("progress", "tq: importing verl"))
            with warnings.catch_warnings():
                # One UserWarning per training engine this CPU install lacks (megatron, torchtitan, ...).
                warnings.simplefilter("ignore")
                import verl.trainer.ppo.v1.replay_buffer  # noqa: F401  (seconds: not a phase's cost)
        # After verl's import, which sets its own level.
        for name, level in (("buffer", logging.CRITICAL), ("poller", logging.CRITICAL),
                            ("verl.trainer.ppo.v1.replay_buffer", logging.WARNING)):
            logging.getLogger(name).setLevel(level)
        import buffer

        conn.send(("progress", f"tq: the host imports buffer from {os.path.dirname(os.path.abspath(buffer.__file__))}"))
        yield _controller_pid()
    finally:
        try:
            if started_store:
                from examples.verl_style_trainer import stop_store

                stop_store()
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)


def serve(conn: Connection, plan: Any, phases: str) -> None:
    """The whole benchmark of ``plan`` (a :class:`bench.tq.Plan`) in this process.

    Sends ``("progress", text)`` throughout, per K first ``("alone", {"k",
    "costs"})`` (:func:`costs_alone`, when phase c runs), then a ``("phase",
    record)`` per phase: ``plan.min_rounds`` rounds, and one more while a
    sampler phase's slowdown interval is wider than
    :data:`bench.tq.HALF_WIDTH`, up to ``plan.max_rounds``; then a ``("wake",
    record)`` per block of the wake-up line (:func:`bench.tq_wake.run`,
    ``plan.wake_samples`` per sampler and kind), and at the end ``("done",
    None)`` or ``("error", traceback)``. Everything started here is stopped
    before it returns."""
    from .tq import resolved, slowdowns_of

    try:
        with live_store(conn, "c" in phases) as controller:
            import ray

            writer: Any = None
            try:
                actor_class: Any = ray.remote(num_cpus=1)(Writer)
                writer = actor_class.remote([f"g{n:07d}" for n in range(WRITER_POOL)])
                groups = 0
                for k in plan.sizes:
                    conn.send(("progress", f"tq: preloading {k:,} keys"))
                    preload(groups, k // GROUP_KEYS)
                    if not groups:
                        ray.get(writer.run.remote(0.5), timeout=_CALL_TIMEOUT)  # the actor is up, its client warm
                    groups = k // GROUP_KEYS
                    if "c" in phases:
                        conn.send(("progress", f"tq: K={k:,}: the controller's CPU per listing and per read, alone"))
                        prompts = [f"g{n:07d}" for n in range(min(max(WATCH_KEYS), groups))]
                        conn.send(("alone", {"k": k, "costs": costs_alone(controller, k, plan.min_rounds, prompts)}))
                    records: list[dict[str, Any]] = []
                    order, rounds = schedule(phases, plan.min_rounds), plan.min_rounds
                    while True:
                        for r, name in order:
                            record = _phase(name, writer, controller, plan.seconds)
                            record.update(k=k, round=r, seq=len(records))
                            records.append(record)
                            conn.send(("phase", record))
                        if rounds >= plan.max_rounds or resolved(slowdowns_of(records)):
                            break
                        conn.send(("progress", f"tq: K={k:,}: a slowdown interval is still wider than the goal's "
                                               f"resolution after {rounds} rounds: one more"))
                        order, rounds = more_rounds(phases, rounds), rounds + 1
                    if plan.wake_samples:
                        from . import tq_wake

                        conn.send(("progress", f"tq: K={k:,}: finished -> the call returns, {plan.wake_samples} "
                                               f"per sampler and kind"))
                        for record in tq_wake.run(k, plan.wake_samples, "c" in phases, plan.wake_kinds,
                                                  lambda text: conn.send(("progress", text))):
                            conn.send(("wake", record))
                conn.send(("done", None))
            finally:
                if writer is not None:
                    ray.kill(writer)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


#: Seconds over which the controller's idle CPU is read before the family's wake-ups at each K.
IDLE_SECONDS = 5.0
#: A controller thread serves requests when a burst of them costs it at least this share of their CPU.
_SERVING_SHARE = 0.05


def _task_cpu(path: str) -> float | None:
    """CPU seconds from a ``/proc/<pid>/task/<tid>/schedstat`` file (nanoseconds on the CPU); None once gone."""
    try:
        with open(path) as f:
            return int(f.read().split()[0]) / 1e9
    except (FileNotFoundError, ProcessLookupError):
        return None


@dataclass
class ControllerCpu:
    """The TransferQueue controller's CPU, read two ways: the threads that serve requests (``schedstat``,
    nanoseconds) and the whole process (``/proc/<pid>/stat``, 10 ms ticks); each with its idle CPU per second.

    At 10k keys a listing costs the controller ~2 ms while its process idles at ~5 ms a second (Ray's own
    threads, mostly its main thread), counted in 10 ms ticks: a wake-up's share of the whole process is lost
    in the noise, that of the serving threads is not.
    """

    pid: int
    threads: list[str]
    idle_threads: float = 0.0
    idle_process: float = 0.0

    def serving(self) -> float:
        """CPU seconds of the serving threads so far (a thread gone since counts no more)."""
        return sum(value for value in map(_task_cpu, self.threads) if value is not None)

    def process(self) -> float:
        """CPU seconds of the whole process so far."""
        return cpu_seconds(f"/proc/{self.pid}/stat")


def controller_cpu(pid: int, probe: Callable[[], Any], requests: int = 20, quiet: float = 2.0) -> ControllerCpu:
    """Find the controller's serving threads: those whose CPU, beyond their own idle rate over ``quiet`` s,
    rose by at least :data:`_SERVING_SHARE` of what ``requests`` calls of ``probe`` cost; then read both idle
    rates over :data:`IDLE_SECONDS`."""

    def snapshot() -> dict[str, float]:
        out = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            value = _task_cpu(f"/proc/{pid}/task/{tid}/schedstat")
            if value is not None:
                out[tid] = value
        return out

    first, began = snapshot(), time.monotonic()
    time.sleep(quiet)
    second, middle = snapshot(), time.monotonic()
    for _ in range(requests):
        probe()
    third, ended = snapshot(), time.monotonic()
    excess = {tid: value - second[tid] - (second[tid] - first[tid]) / (middle - began) * (ended - middle)
              for tid, value in third.items() if tid in second and tid in first}
    total = sum(max(0.0, value) for value in excess.values())
    threads = [f"/proc/{pid}/task/{tid}/schedstat" for tid, value in sorted(excess.items())
               if total > 0 and value >= _SERVING_SHARE * total]
    meter = ControllerCpu(pid, threads)
    serving, process, began = meter.serving(), meter.process(), time.monotonic()
    time.sleep(IDLE_SECONDS)
    seconds = time.monotonic() - began
    meter.idle_threads = (meter.serving() - serving) / seconds
    meter.idle_process = (meter.process() - process) / seconds
    return meter


def serve_family(conn: Connection, plan: Any) -> None:
    """The wake-up family of ``plan`` (a :class:`bench.wake_family.FamilyPlan`) in this process.

    Per K (the store preloaded as for ``--only tq``, no writer): the
    controller's serving threads and idle CPU (:func:`controller_cpu`), then
    :func:`bench.tq_wake.run_family`. Sends ``("progress", text)``
    throughout, a ``("wake", record)`` per block, and at the end ``("done",
    None)`` or ``("error", traceback)``. Everything started here is stopped
    before it returns.
    """
    import transfer_queue as tq

    from . import tq_wake

    def probe() -> None:
        # The requests the wake-ups send: verl's listing, a rollout's put, a trainer's clear.
        tq.kv_list()
        tq.kv_put(key="probe", partition_id=PARTITION, tag={"global_steps": 0, "status": "success"})
        tq.kv_clear(keys=["probe"], partition_id=PARTITION)

    try:
        with live_store(conn, True) as controller:
            groups = 0
            for k in plan.sizes:
                conn.send(("progress", f"wake-family: preloading {k:,} keys"))
                preload(groups, k // GROUP_KEYS)
                groups = k // GROUP_KEYS
                meter = controller_cpu(controller, probe)
                conn.send(("progress", f"wake-family: K={k:,}: the controller's {len(meter.threads)} serving "
                                       f"thread(s) idle at {meter.idle_threads * 1e3:.2g} ms/s, its process at "
                                       f"{meter.idle_process * 1e3:.2g} ms/s"))
                tq_wake.run_family(k, plan, meter, lambda record: conn.send(("wake", record)),
                                   lambda text: conn.send(("progress", text)))
            conn.send(("done", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
