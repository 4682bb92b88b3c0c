"""verl's own ``TaskRunnerV1``, with the model side faked and every sampler call recorded (runs as verl's
TaskRunner Ray actor; tests/integration/verl_loop.py starts it through verl's ``run_ppo``).

:class:`LoopTaskRunner` runs ``TaskRunnerV1.run`` unchanged (``tq.init``, the trainer of the mode, ``init``, the
agent loop manager, ``fit``, ``tq.close`` in its ``finally``). Before it, in this process only, it installs the
fakes (:mod:`tests.integration.verl_loop_fakes`) and :class:`Recorder`, which wraps, without changing what they
do or return:

* the samplers' public calls (``sample``, ``get_sampleable_count``, ``wait_for_sampleable`` of buffer.verl's
  classes and of verl's own): kind, arguments, start and end (``time.monotonic``, one clock for every process of
  the machine), the batch handed out (keys, tags) or the count;
* ``transfer_queue.kv_clear``: who cleared (the sampler: a selected or evicted group; the trainer: its batch
  after the step), which keys, and, when ``snapshot_clears`` is set (the test), the store's tags of those prompts
  and the trajectories their groups had at that moment (one ``kv_list`` of the partition first);
* ``transfer_queue.kv_batch_put`` from verl's trainer with prompt tags: the prompts submitted;
* ``transfer_queue.close``: the end of ``fit``; the prompts left in the store are listed before it closes.

The record is written as JSON to ``run.json``'s ``record_path`` when ``run`` ends, also after a failure.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

import ray
from verl.trainer.main_ppo import TaskRunnerV1

from tests.integration import verl_loop_fakes as fakes

#: The directory the harness shares with this actor: ``run.json`` (this run's settings), the rollout state.
DIR_ENV = "VERL_LOOP_DIR"
SETTINGS_FILE = "run.json"
_PRELOAD_CHUNK = 10_000
_CALL_TIMEOUT = 60.0

SAMPLER_MODULES = {"buffer.verl.link": "sampler", "buffer.verl.sampler": "sampler",
                   "verl.trainer.ppo.v1.replay_buffer": "sampler", "verl.trainer.ppo.v1.trainer_base": "trainer"}


def read_settings() -> dict[str, Any]:
    """This run's settings, written by the harness before it started the run."""
    with open(os.path.join(os.environ[DIR_ENV], SETTINGS_FILE)) as f:
        settings: dict[str, Any] = json.load(f)
    return settings


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` from ``/proc`` (the command name may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_of(pid: int) -> list[int]:
    """The direct children of ``pid`` (all its threads'), from ``/proc``."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(child) for child in f.read().split()]
    except OSError:
        pass
    return found


class Recorder:
    """Wraps the calls named in the module docstring and keeps what they did, in order."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.calls: list[dict[str, Any]] = []
        self.clears: list[dict[str, Any]] = []
        self.submits: list[dict[str, Any]] = []
        self.poller_pids: list[int] = []
        self.poll_interval: float | None = None
        self.fit: dict[str, Any] = {}
        self.final: dict[str, Any] = {}
        self.error: str | None = None
        self.controller_pid: int | None = None
        self._local = threading.local()

    # -- installing ---------------------------------------------------------------------------

    def install(self) -> None:
        import transfer_queue as tq
        from verl.trainer.ppo.v1 import replay_buffer as verl_sampler

        import buffer.verl.sampler as ours

        for cls in (ours.ReplayBuffer, ours.ReplayBufferAsync, verl_sampler.ReplayBuffer,
                    verl_sampler.ReplayBufferAsync):
            for name in ("sample", "get_sampleable_count", "wait_for_sampleable"):
                if name in cls.__dict__:
                    setattr(cls, name, self._timed(name, cls.__dict__[name]))
        tq.kv_clear = self._clearing(tq.kv_clear)
        tq.kv_batch_put = self._putting(tq.kv_batch_put)
        tq.close = self._closing(tq.close)

    def _timed(self, kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        @functools.wraps(method)
        def timed(sampler: Any, *args: Any, **kwargs: Any) -> Any:
            # verl's own async sample() calls its wait_for_sampleable(): only the outer call is the trainer's.
            depth = getattr(recorder._local, "depth", 0)
            if depth:
                return method(sampler, *args, **kwargs)
            recorder._local.depth = 1
            call: dict[str, Any] = {"kind": kind, "args": _plain(args), "kwargs": _plain(kwargs),
                                    "sampler": type(sampler).__module__, "t0": time.monotonic()}
            try:
                result = method(sampler, *args, **kwargs)
            except BaseException as exc:
                call["error"] = repr(exc)
                raise
            finally:
                call["t1"] = time.monotonic()
                recorder._local.depth = 0
                recorder.calls.append(call)
            call.update(_result(kind, result))
            recorder._note_poller(sampler)
            return result

        return timed

    def _note_poller(self, sampler: Any) -> None:
        if self.poll_interval is None:
            self.poll_interval = getattr(sampler, "poll_interval", None)  # where sampler_kwargs show
        if self.poller_pids or not hasattr(sampler, "stats"):
            return
        pid = sampler.stats().get("poller_pid")
        if pid:
            self.poller_pids = [pid, *children_of(pid)]  # its watchdog is its child

    def _clearing(self, kv_clear: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        @functools.wraps(kv_clear)
        def clear(keys: Any, partition_id: str) -> Any:
            import transfer_queue as tq

            keys = [keys] if isinstance(keys, str) else list(keys)
            by = SAMPLER_MODULES.get(sys._getframe(1).f_globals.get("__name__", ""), "other")
            entry: dict[str, Any] = {"by": by, "partition": partition_id, "keys": keys, "t": time.monotonic()}
            if by == "sampler" and recorder.settings.get("snapshot_clears"):
                held = (tq.kv_list(partition_id) or {}).get(partition_id, {})
                uids = {key for key in keys if "_" not in key}
                entry["prompt_tags"] = {key: _plain(held[key]) for key in uids if key in held}
                entry["store_trajectories"] = {uid: sorted(k for k in held if k.split("_", 1)[0] == uid and k != uid)
                                               for uid in uids}
            recorder.clears.append(entry)
            return kv_clear(keys=keys, partition_id=partition_id)

        return clear

    def _putting(self, kv_batch_put: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        @functools.wraps(kv_batch_put)
        def put(keys: Any, partition_id: str, fields: Any = None, tags: Any = None) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller == "verl.trainer.ppo.v1.trainer_base" and tags and all(t.get("is_prompt") for t in tags):
                recorder.submits.append({"partition": partition_id, "keys": list(keys), "t": time.monotonic(),
                                         "global_steps": [t.get("global_steps") for t in tags]})
            return kv_batch_put(keys=keys, partition_id=partition_id, fields=fields, tags=tags)

        return put

    def _closing(self, close: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        @functools.wraps(close)
        def closing(*args: Any, **kwargs: Any) -> Any:
            recorder.end_of_fit()
            return close(*args, **kwargs)

        return closing

    # -- around fit --------------------------------------------------------------------------

    def start_of_fit(self) -> None:
        self.controller_pid = _controller_pid()
        self.fit = {"t0": time.monotonic(), "controller_cpu0": cpu_seconds(self.controller_pid)}

    def end_of_fit(self) -> None:
        import transfer_queue as tq

        if self.fit and "t1" not in self.fit:
            self.fit["t1"] = time.monotonic()
            if self.controller_pid is not None:
                self.fit["controller_cpu1"] = cpu_seconds(self.controller_pid)
        try:
            listing = tq.kv_list() or {}
        except Exception as exc:  # the store's state is reported, not fatal to the run's record
            self.final = {"error": repr(exc)}
            return
        self.final = {"prompts": {pid: {k: _plain(t) for k, t in items.items() if t.get("is_prompt")}
                                  for pid, items in listing.items()},
                      "keys": {pid: len(items) for pid, items in listing.items()}}

    def dump(self) -> None:
        record = {"settings": self.settings, "calls": self.calls, "clears": self.clears, "submits": self.submits,
                  "fit": self.fit, "final": self.final, "poller_pids": self.poller_pids, "error": self.error,
                  "poll_interval": self.poll_interval,
                  "taskrunner_pid": os.getpid(), "controller_pid": self.controller_pid}
        path = self.settings["record_path"]
        with open(f"{path}.tmp", "w") as f:
            json.dump(record, f)
        os.replace(f"{path}.tmp", path)


def _controller_pid() -> int:
    controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    pid: Any = ray.get(controller.__ray_call__.remote(lambda actor: os.getpid()), timeout=_CALL_TIMEOUT)
    return int(pid)


def _result(kind: str, result: Any) -> dict[str, Any]:
    if kind == "sample":
        batch, metrics = result
        return {"keys": list(batch.keys), "tags": [_plain(t) for t in batch.tags], "metrics": _plain(metrics)}
    if kind == "wait_for_sampleable":
        uids, metrics = result
        return {"count": len(uids), "metrics": _plain(metrics)}
    return {"count": int(result)}


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: numpy and torch scalars as numbers, containers walked."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return repr(value)


def preload(count: int, where: str) -> None:
    """Put ``count`` keys nobody will sample into the store, after ``tq.init`` and before ``fit``.

    ``where="orphans"``: trajectory keys of groups whose prompt is gone, in ``"train"`` (what a trainer that died
    between the sampler's clear of a batch's prompts and its own clear of the trajectories leaves behind); verl's
    sampler and buffer.verl both list them, neither hands them out, verl's resume does not re-issue them.
    ``where="partition"``: keys of another partition, ``"other"`` (verl's sampler lists every partition).
    """
    import transfer_queue as tq

    partition = "train" if where == "orphans" else "other"
    tag = {"status": "success", "global_steps": 0, "seq_len": 16, "min_global_steps": 0, "max_global_steps": 0}
    for start in range(0, count, _PRELOAD_CHUNK):
        keys = [f"orphan{n // 16:06d}_{n % 16}_0" for n in range(start, min(count, start + _PRELOAD_CHUNK))]
        tq.kv_batch_put(keys=keys, partition_id=partition, tags=[dict(tag) for _ in keys])


@ray.remote
class LoopTaskRunner(TaskRunnerV1.__ray_actor_class__):  # type: ignore[name-defined,misc]
    """verl's ``TaskRunnerV1``: the same ``run``, in a process where the fakes and the recorder are installed."""

    def init_agent_loop_manager(self) -> None:
        # Called by TaskRunnerV1.run between trainer.init() and trainer.fit(): preload the store, then verl's own.
        settings = self._loop_settings
        if settings.get("preload"):
            preload(settings["preload"], settings.get("preload_where", "orphans"))
        super().init_agent_loop_manager()
        self._loop_recorder.start_of_fit()

    def run(self, config: Any) -> None:
        settings = read_settings()
        self._loop_settings = settings
        self._loop_recorder = recorder = Recorder(settings)
        fakes.install(fakes.RolloutSettings(
            state_path=fakes.reset_state(os.environ[DIR_ENV]), seed=settings["seed"],
            delay=tuple(settings["delay"]), failure_rate=settings["failure_rate"]),
            train_seconds=settings.get("train_seconds"))
        recorder.install()
        try:
            super().run(config)
        except BaseException:
            recorder.error = traceback.format_exc()
            raise
        finally:
            recorder.dump()
