"""The host side of ``python -m bench --only tq``: runs in a process of its own, where TransferQueue is live.

::

    runner (bench.tq) ──spawn──▶ host: ray.init + tq.init (the trainer's process, as verl's TaskRunner)
         ▲                        │── preloads K keys into partition "train"
         │ pipe: progress,        │── Writer actor (a rollout worker): kv_batch_put of 16 keys, in a loop
         │       one record       │── phase a: nothing else
         │       per phase        │── phase b: buffer.verl blocked in sample() (its poller process lists)
         └────────────────────────┘── phase c: verl 0.9.1's sampler blocked in sample() in a thread

Each phase measures the writer (batches/s, put latency) and the CPU of the
TransferQueue controller's process over the writer's run, plus the CPU of
whatever lists the store for the sampler (buffer.verl's poller process, or
the thread that runs verl's ``sample()``). Nothing here is imported by the
runner process: Ray's threads and processes stay out of the other benchmarks.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import traceback
import warnings
from multiprocessing.connection import Connection
from typing import Any, Callable

PARTITION = "train"
BATCH_KEYS = 16  # one GRPO group of rollouts per put, as verl's agent loop finishes them
GROUP_KEYS = 16  # a preloaded group: its prompt key and 15 trajectories
WRITER_POOL = 64  # groups the writer cycles through, so K stays what was preloaded
NEVER = 1_000_000  # groups asked of sample(): more than will ever be terminal, so it waits the whole phase
_CALL_TIMEOUT = 120.0  # any single Ray or store call of the host


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
        """Put batches for ``seconds``; returns the count, the loop's wall time and each put's latency."""
        import transfer_queue as tq

        latencies: list[float] = []
        started = time.perf_counter()
        end = started + seconds
        while time.perf_counter() < end:
            uid = self._uids[self._written % len(self._uids)]
            step = 1 + self._written // len(self._uids)
            keys = [f"{uid}_{i}_0" for i in range(BATCH_KEYS)]
            tags = [{"global_steps": step, "status": "success", "reward": float((self._written + i) % 2)}
                    for i in range(BATCH_KEYS)]
            put = time.perf_counter()
            tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=self._fields, tags=tags)
            latencies.append(time.perf_counter() - put)
            self._written += 1
        return {"batches": len(latencies), "seconds": time.perf_counter() - started, "latencies": latencies}


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

    ``lister_stat`` names the ``/proc`` stat file of what lists the store for
    the sampler (None: the blocked thread itself); ``stop`` ends the phase,
    after which ``sample()`` must raise ``expected``.
    """

    def __init__(self, sample: Callable[[], Any], stop: Callable[[], Any], listings: Callable[[], int],
                 lister_stat: str | None, expected: type[BaseException]) -> None:
        self._stop = stop
        self.listings = listings
        self._expected = expected
        self._outcome: list[BaseException | None] = []
        self._thread = threading.Thread(target=self._run, args=(sample,), name="bench-tq-sample", daemon=True)
        self._thread.start()
        # native_id is set by the time start() returns.
        self._lister_stat = lister_stat or f"/proc/self/task/{self._thread.native_id}/stat"

    def _run(self, sample: Callable[[], Any]) -> None:
        try:
            sample()
            self._outcome.append(None)
        except BaseException as exc:  # the phase's end stops it with an exception; end() checks which
            self._outcome.append(exc)

    def lister_cpu(self) -> float:
        return cpu_seconds(self._lister_stat)

    def end(self) -> None:
        """Stop the sampler; its ``sample()`` must end with the expected exception within the deadline."""
        self._stop()
        self._thread.join(_CALL_TIMEOUT)
        if self._thread.is_alive():
            raise TimeoutError("sample() did not return after its phase ended")
        outcome = self._outcome[0]
        if not isinstance(outcome, self._expected):
            raise RuntimeError(f"sample() ended with {outcome!r}, not {self._expected.__name__}: "
                               "it must wait for the whole phase") from outcome


def _empty() -> Any:
    """An empty config section, as verl's trainer passes ``trainer_config`` and ``sampler_kwargs`` (OmegaConf)."""
    from omegaconf import OmegaConf

    return OmegaConf.create({})


def _product() -> _Blocked:
    """buffer.verl as a verl trainer builds it (six keywords, no sampler_kwargs), blocked in ``sample()``."""
    from buffer.errors import BufferClosed
    from buffer.verl import ReplayBuffer

    sampler = ReplayBuffer(trainer_mode="colocate_async", trainer_config=_empty(), max_off_policy_threshold=None,
                           max_off_policy_strategy="drop", sampler_kwargs=_empty(), refill_fn=None)
    try:
        sampler.get_sampleable_count(1, PARTITION)  # starts the poller and waits for its first listing
        poller = sampler.stats()["poller_pid"]
        return _Blocked(lambda: sampler.sample(global_steps=1, partition_id=PARTITION, batch_size=NEVER),
                        sampler.close, lambda: int(sampler.stats()["polls"]), f"/proc/{poller}/stat", BufferClosed)
    except BaseException:
        sampler.close()
        raise


def _verl() -> _Blocked:
    """verl 0.9.1's own ``ReplayBufferAsync`` as its trainer builds it, blocked in ``sample()`` in a thread.

    verl's sampler never gives up; the subclass waits its ``poll_interval``
    on an event instead of ``time.sleep`` so the phase's end can stop it, and
    counts its listings. Nothing else of verl's code changes.
    """
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    stop = threading.Event()
    listings = [0]

    class Stoppable(ReplayBufferAsync):  # type: ignore[misc]
        def _sync_metadata_from_transfer_queue(self) -> None:
            listings[0] += 1
            super()._sync_metadata_from_transfer_queue()

        def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
            if stop.wait(self.poll_interval):
                raise PhaseStopped()
            return last_debug_time

    sampler = Stoppable(trainer_mode="colocate_async", trainer_config=_empty(), max_off_policy_threshold=None,
                        max_off_policy_strategy="drop", sampler_kwargs=_empty(), refill_fn=None)
    return _Blocked(lambda: sampler.sample(global_steps=1, partition_id=PARTITION, batch_size=NEVER),
                    stop.set, lambda: listings[0], None, PhaseStopped)


SAMPLERS: dict[str, Callable[[], _Blocked] | None] = {"a": None, "b": _product, "c": _verl}


def _phase(name: str, writer: Any, controller: int, seconds: float) -> dict[str, Any]:
    """One phase: the sampler of ``name`` (if any) blocked, the writer running ``seconds``; the figures."""
    import ray

    make = SAMPLERS[name]
    blocked = make() if make is not None else None
    try:
        time.sleep(0.2)  # into its wait loop (verl's first listing may still run: it lists all phase anyway)
        listings = blocked.listings() if blocked else 0
        lister = blocked.lister_cpu() if blocked else 0.0
        cpu, wall = cpu_seconds(f"/proc/{controller}/stat"), time.perf_counter()
        out = ray.get(writer.run.remote(seconds), timeout=seconds + _CALL_TIMEOUT)
        wall = time.perf_counter() - wall
        out["controller_cpu"] = (cpu_seconds(f"/proc/{controller}/stat") - cpu) / wall
        out["lister_cpu"] = (blocked.lister_cpu() - lister) / wall if blocked else None
        out["listings_per_s"] = (blocked.listings() - listings) / wall if blocked else None
    finally:
        if blocked is not None:
            blocked.end()
    out["phase"] = name
    return out


def _controller_pid() -> int:
    import ray

    controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    pid: Any = ray.get(controller.__ray_call__.remote(lambda actor: os.getpid()), timeout=_CALL_TIMEOUT)
    return int(pid)


def serve(conn: Connection, sizes: list[int], rounds: int, seconds: float, phases: str) -> None:
    """The whole benchmark in this process; sends ``("progress", text)``, ``("phase", record)``, then
    ``("done", info)`` or ``("error", traceback)``. Everything started here is stopped before it returns."""
    # Ray's socket paths must fit in 108 bytes: a short directory under /tmp.
    temp_dir = tempfile.mkdtemp(prefix="bench-tq-", dir="/tmp")
    started_store = False
    writer: Any = None
    try:
        from examples.verl_style_trainer import start_store

        conn.send(("progress", "tq: starting Ray and TransferQueue"))
        start_store(temp_dir=temp_dir)
        started_store = True
        if "c" in phases:
            conn.send(("progress", "tq: importing verl"))
            with warnings.catch_warnings():
                # One UserWarning per training engine this CPU install lacks (megatron, torchtitan, ...).
                warnings.simplefilter("ignore")
                import verl.trainer.ppo.v1.replay_buffer  # noqa: F401  (seconds: not a phase's cost)
        # As in the runner: the product's restarts and escalations, and verl's INFO lines, are noise here
        # (after verl's import, which sets its own level).
        for name, level in (("buffer", logging.CRITICAL), ("poller", logging.CRITICAL),
                            ("verl.trainer.ppo.v1.replay_buffer", logging.WARNING)):
            logging.getLogger(name).setLevel(level)
        import ray

        controller = _controller_pid()
        actor_class: Any = ray.remote(num_cpus=1)(Writer)
        writer = actor_class.remote([f"g{n:07d}" for n in range(WRITER_POOL)])
        groups = 0
        for k in sizes:
            conn.send(("progress", f"tq: preloading {k:,} keys"))
            preload(groups, k // GROUP_KEYS)
            if not groups:
                ray.get(writer.run.remote(0.5), timeout=_CALL_TIMEOUT)  # the actor is up and its client warm
            groups = k // GROUP_KEYS
            for r in range(rounds):
                # Rotated each round, so a drift of the machine's load falls on every phase alike.
                order = phases[r % len(phases):] + phases[:r % len(phases)]
                for name in order:
                    record = _phase(name, writer, controller, seconds)
                    record.update(k=k, round=r)
                    conn.send(("phase", record))
        conn.send(("done", {"controller_pid": controller}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        try:
            if writer is not None:
                import ray

                ray.kill(writer)
        finally:
            if started_store:
                from examples.verl_style_trainer import stop_store

                stop_store()
            shutil.rmtree(temp_dir, ignore_errors=True)
            conn.close()
