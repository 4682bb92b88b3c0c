"""verl 0.9.1's own v1 trainer loop on CPU against a real TransferQueue, with only verl's model side faked.

Used by tests/integration/test_verl_loop.py and ``python -m bench --only verl-loop``::

    test / bench ──spawn──▶ host (a session of its own): for each run, as verl's main() does
         ▲                    hydra compose of verl's ppo_trainer.yaml + overrides, validate_config,
         │ pipe: progress,    run_ppo(config, task_runner_class=LoopTaskRunner)
         │ one record per run   └─▶ Ray (started by run_ppo from ray_kwargs) ─▶ LoopTaskRunner actor:
         │ the Ray pids             TaskRunnerV1.run: tq.init, trainer, init, agent loop manager, fit, tq.close
         └─────────────────────     (tests/integration/verl_loop_runner.py; fakes: verl_loop_fakes.py)

The sampler under test is chosen in the config, the way users choose it:
``trainer.v1.sampler.custom_sampler.path=pkg://buffer.verl`` and ``...name=ReplayBuffer`` (no ``sampler_kwargs``
unless the run gives them on the command line); the baseline is verl's built-in sampler (no custom sampler).
Every Ray process runs this checkout's code: the host puts it first on ``PYTHONPATH`` and the runs pass it to Ray
through ``ray_kwargs.ray_init.runtime_env.env_vars``.

After each run the host waits (with a deadline) for the TaskRunner actor's process and the sampler's poller to
be gone; after the last it shuts Ray down and reports Ray's processes, which the caller checks are gone too.
:func:`check` holds the invariants every batch must keep.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
MODES = ("sync", "colocate_async", "separate_async")
#: The sampler under test, loaded the way a user's config names it.
CUSTOM_SAMPLER = ("trainer.v1.sampler.custom_sampler.path=pkg://buffer.verl",
                  "trainer.v1.sampler.custom_sampler.name=ReplayBuffer")
#: ``sampler_kwargs`` on hydra's command line: a key added to the empty mapping (the form docs/verl.md gives).
SAMPLER_KWARGS_OVERRIDE = "+trainer.v1.sampler.sampler_kwargs.poll_interval=0.05"
#: Tags verl's trainer reads from every trajectory of a batch (_balance_batch, _compute_metrics, the sampler).
TAGS_VERL_READS = ("seq_len", "min_global_steps", "max_global_steps", "global_steps", "status")
_RAY_CPUS = 8  # logical: TransferQueue's controller, its storage unit, the TaskRunner and the agent loop worker
_EXIT_DEADLINE = 60.0  # a process of a run (TaskRunner, poller) or of Ray must be gone this long after its end


@dataclass(frozen=True)
class LoopRun:
    """One ``fit`` of verl's trainer: the mode, the sampler (``"buffer.verl"`` or ``"verl"``) and the loop's sizes."""

    name: str
    mode: str
    sampler: str = "buffer.verl"
    steps: int = 3
    batch_size: int = 4  # prompts per step (data.train_batch_size)
    n: int = 2  # trajectories per prompt (actor_rollout_ref.rollout.n)
    val_n: int = 1  # per validation prompt (actor_rollout_ref.rollout.val_kwargs.n)
    threshold: int = 2  # trainer.v1.sampler.max_off_policy_threshold (drop)
    parameter_sync_step: int = 2  # separate_async: mini-batches per step
    sampler_kwargs: tuple[str, ...] = ()  # hydra overrides of sampler_kwargs, e.g. SAMPLER_KWARGS_OVERRIDE
    preload: int = 0  # keys nobody samples, put into the store before fit (verl_loop_runner.preload)
    preload_where: str = "orphans"
    failure_rate: float = 0.0  # share of LLM calls that fail (their group ends as "failure")
    seed: int = 0
    delay: tuple[float, float] = (0.1, 1.2)  # seconds of one LLM call
    train_seconds: float = 0.3  # update_actor's "training"
    validate: bool = False  # validation before training (partition "val")
    snapshot_clears: bool = True  # list the partition at each sampler clear (the checks' ground truth)
    overrides: tuple[str, ...] = field(default=())


def overrides(run: LoopRun, directory: str, model: str) -> list[str]:
    """Hydra overrides of verl's ``ppo_trainer.yaml`` for ``run``, as a user would pass them on the command line."""
    mini_batch = run.batch_size // run.parameter_sync_step if run.mode == "separate_async" else run.batch_size
    items = [
        "trainer.use_v1=True",
        f"trainer.v1.trainer_mode={run.mode}",
        f"trainer.v1.sampler.max_off_policy_threshold={run.threshold}",
        "trainer.v1.sampler.max_off_policy_strategy=drop",
        f"trainer.v1.separate_async.parameter_sync_step={run.parameter_sync_step}",
        "trainer.v1.separate_async.hybrid_rollout.enable_switch=True",
        f"data.train_batch_size={run.batch_size}",
        "data.dataloader_num_workers=0",
        "data.train_files=verl-loop-train",
        "data.val_files=verl-loop-val",
        f"data.val_max_samples={run.batch_size}",
        "data.custom_cls.path=pkg://tests.integration.verl_loop_fakes",
        "data.custom_cls.name=PromptDataset",
        "data.max_prompt_length=64",
        "data.max_response_length=32",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={run.n}",
        f"actor_rollout_ref.rollout.val_kwargs.n={run.val_n}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.device=cpu",
        f"trainer.total_training_steps={run.steps}",
        "trainer.total_epochs=1000",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        f"trainer.val_before_train={run.validate}",
        "trainer.resume_mode=disable",
        "trainer.logger=[console]",
        "trainer.project_name=verl-loop",
        f"trainer.experiment_name={run.name}",
        f"trainer.default_local_dir={directory}/checkpoints",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        f"ray_kwargs.ray_init.num_cpus={_RAY_CPUS}",
        # Ray's scheduling count of GPUs: verl's resource pool checks for them; nothing runs on one.
        "+ray_kwargs.ray_init.num_gpus=1",
        "+ray_kwargs.ray_init.include_dashboard=False",
        "+ray_kwargs.ray_init.log_to_driver=False",
        f"+ray_kwargs.ray_init.object_store_memory={256 * 1024 * 1024}",
        # Loopback only: Ray workers report 127.0.0.1 and TransferQueue binds there (examples/verl_style_trainer).
        "+ray_kwargs.ray_init._node_ip_address=127.0.0.1",
        f"+ray_kwargs.ray_init._temp_dir={directory}/ray",
        # This checkout first in every Ray process, before the editable install of another one.
        f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH={REPO}",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_LOOP_DIR={directory}",
        "+ray_kwargs.ray_init.runtime_env.env_vars.RAY_USAGE_STATS_ENABLED='0'",
    ]
    if run.sampler == "buffer.verl":
        items += CUSTOM_SAMPLER
    elif run.sampler != "verl":
        raise ValueError(f"unknown sampler {run.sampler!r}: 'buffer.verl' or 'verl'")
    return items + list(run.sampler_kwargs) + list(run.overrides)


def compose(items: list[str]) -> Any:
    """verl's ``ppo_trainer.yaml`` composed with ``items``, as ``python -m verl.trainer.main_ppo ITEMS`` would."""
    import importlib.util

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    # Found, not imported: importing verl here would bring torch and its threads into the caller's process.
    spec = importlib.util.find_spec("verl")
    assert spec is not None and spec.submodule_search_locations, "verl is not installed"
    config_dir = os.path.join(list(spec.submodule_search_locations)[0], "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=items)


# -- the host process ---------------------------------------------------------------------------------


class LoopHost:
    """The caller's handle on the host: starts it with the runs, yields their records, checks Ray is gone."""

    def __init__(self, runs: list[LoopRun], run_timeout: float = 600.0) -> None:
        self.runs = runs
        self.run_timeout = run_timeout
        self.ray_pids: list[int] = []
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, [asdict(r) for r in runs]), name="verl-loop-host")
        self.process.start()
        child.close()

    def results(self, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
        """Every run's record, in order (``record["error"]`` holds a run's failure); then Ray's pids are known."""
        records: list[dict[str, Any]] = []
        try:
            while True:
                # Per message: a run's start-up (Ray, verl's imports in two actors) and its fit on a loaded machine.
                if not self._conn.poll(self.run_timeout):
                    raise TimeoutError(f"the verl loop host sent nothing for {self.run_timeout:g} s")
                kind, value = self._conn.recv()
                if kind == "progress":
                    if progress is not None:
                        progress(value)
                elif kind == "record":
                    records.append(value)
                elif kind == "done":
                    self.ray_pids = value
                    return records
                else:
                    raise RuntimeError(f"the verl loop host failed:\n{value}")
        finally:
            self.close()

    def close(self, timeout: float = 120.0) -> None:
        """Reap the host; past the deadline SIGKILL its process group (Ray's processes are in it)."""
        self.process.join(timeout)
        if self.process.is_alive() and self.process.pid is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.join(10)
        self._conn.close()

    def leftovers(self, deadline: float = _EXIT_DEADLINE) -> list[str]:
        """Ray's processes still running ``deadline`` seconds after the host ended (they should be gone at once)."""
        return _still_running({pid: "ray" for pid in self.ray_pids}, deadline)


def _serve(conn: Connection, runs: list[dict[str, Any]]) -> None:
    # A session of its own: the caller can end the host and every process it started (Ray's) with one killpg.
    os.setsid()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # TransferQueue's and verl's INFO lines go to Ray's log files (log_to_driver=False); the host's own are few.
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARNING")
    # Ray's socket paths must fit in 108 bytes: a short directory, not the tests' deep TMPDIR.
    directory = tempfile.mkdtemp(prefix="verl-loop-", dir="/tmp")
    os.environ["VERL_LOOP_DIR"] = directory
    try:
        from tests.integration.verl_loop_fakes import write_model

        model = write_model(os.path.join(directory, "model"))
        for spec in runs:
            run = LoopRun(**{**spec, "delay": tuple(spec["delay"]), "sampler_kwargs": tuple(spec["sampler_kwargs"]),
                             "overrides": tuple(spec["overrides"])})
            conn.send(("progress", f"{run.name}: {run.mode}, {run.sampler}, {run.steps} steps"))
            conn.send(("record", _one_run(run, directory, model)))
        conn.send(("done", _ray_processes()))
        import ray

        ray.shutdown()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        # VERL_LOOP_KEEP=1 keeps Ray's logs (the agent loop worker's, the TaskRunner's) for a look afterwards.
        if os.environ.get("VERL_LOOP_KEEP") != "1":
            shutil.rmtree(directory, ignore_errors=True)
        conn.close()


def _one_run(run: LoopRun, directory: str, model: str) -> dict[str, Any]:
    """``run`` the way verl's ``main()`` runs a config; its record, with what was left running after it."""
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    from tests.integration.verl_loop_runner import SETTINGS_FILE, LoopTaskRunner

    record_path = os.path.join(directory, f"record-{run.name}.json")
    settings = {**asdict(run), "record_path": record_path}
    with open(os.path.join(directory, SETTINGS_FILE), "w") as f:
        json.dump(settings, f)
    started = time.monotonic()
    failure = None
    try:
        config = compose(overrides(run, directory, model))
        auto_set_device(config)
        validate_config(config=config, use_reference_policy=need_reference_policy(config),
                        use_critic=need_critic(config))
        run_ppo(config, task_runner_class=LoopTaskRunner)
    except BaseException:
        failure = traceback.format_exc()
    wall = time.monotonic() - started
    try:
        with open(record_path) as f:
            record: dict[str, Any] = json.load(f)
    except OSError:
        record = {"settings": settings}
    record["run_wall"] = wall
    if failure is not None:
        record["error"] = (record.get("error") or "") + failure
    processes = {pid: "poller" for pid in record.get("poller_pids", [])}
    if record.get("taskrunner_pid"):
        processes[record["taskrunner_pid"]] = "TaskRunner"
    record["left_running"] = _still_running(processes, _EXIT_DEADLINE)
    return record


def _ray_processes() -> list[int]:
    """Every process below this one (Ray's GCS, raylet, workers): they must be gone once Ray is shut down."""
    found: list[int] = []
    frontier = [os.getpid()]
    while frontier:
        pid = frontier.pop()
        for task in _tasks(pid):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            frontier += children
    return found


def _tasks(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def _still_running(processes: dict[int, str], deadline: float) -> list[str]:
    """Those of ``processes`` alive after waiting up to ``deadline`` seconds for them to end."""
    from tests.helpers.processes import is_running

    end = time.monotonic() + deadline
    while True:
        alive = [f"{what} (pid {pid})" for pid, what in processes.items() if is_running(pid)]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.1)


# -- the invariants of every batch ------------------------------------------------------------------


def check(record: dict[str, Any]) -> list[str]:
    """What ``record`` (one run) breaks of the sampler's contract with verl's loop; empty when nothing.

    For every batch ``sample()`` handed out: no group handed out twice; each group's prompt was finished or
    failure in the store when the sampler cleared it (its selection), within the call; the batch holds exactly the
    trajectories the store held for the group then (``n`` of them for a finished group); every trajectory's tags
    hold what verl reads; its staleness is within ``max_off_policy_threshold`` (async modes, drop); its weights
    versions are not newer than the step. Per partition, every prompt submitted is consumed, evicted or left in the
    store at the end, once; the evictions the sampler reported in its metrics are those it cleared. The trainer ran
    its steps and cleared each batch; nothing of the run (TaskRunner, poller) was left running.
    """
    problems: list[str] = []
    settings = record["settings"]
    if record.get("error"):
        problems.append(f"the run failed: {record['error'][-3000:]}")
    calls, clears = record.get("calls", []), record.get("clears", [])
    handed: dict[str, set[str]] = {}
    for call in calls:
        if call["kind"] == "sample" and "keys" in call:
            problems += _check_batch(call, settings, clears, handed)
    problems += _check_accounting(record, handed)
    problems += _check_steps(record)
    problems += [f"still running after the run: {what}" for what in record.get("left_running", [])]
    return problems


def completed(record: dict[str, Any]) -> list[str]:
    """The part of :func:`check` that needs no snapshot of the store: the run ended, ran its steps, cleared each
    batch and left nothing running (the benchmark's runs do not list the store at each clear)."""
    problems = [f"the run failed: {record['error'][-3000:]}"] if record.get("error") else []
    problems += _check_steps(record)
    return problems + [f"still running after the run: {what}" for what in record.get("left_running", [])]


def _call_args(call: dict[str, Any], *names: str) -> list[Any]:
    values = list(call["args"])
    return [values[i] if i < len(values) else call["kwargs"][name] for i, name in enumerate(names)]


def _check_batch(call: dict[str, Any], settings: dict[str, Any], clears: list[dict[str, Any]],
                 handed: dict[str, set[str]]) -> list[str]:
    problems: list[str] = []
    step, partition, size = _call_args(call, "global_steps", "partition_id", "batch_size")
    where = f"sample(step {step}, {partition!r})"
    groups: dict[str, list[str]] = {}
    for key, tags in zip(call["keys"], call["tags"]):
        uid = key.split("_", 1)[0]
        groups.setdefault(uid, []).append(key)
        missing = [tag for tag in TAGS_VERL_READS if tag not in tags]
        if missing or tags.get("status") != "success":
            problems.append(f"{where}: {key} has tags {tags} (verl reads {', '.join(TAGS_VERL_READS)})")
            continue
        stale = step - tags["global_steps"] + 1 > settings["threshold"]
        if partition == "train" and settings["mode"] != "sync" and stale:
            problems.append(f"{where}: {key} of step {tags['global_steps']} spans more than "
                            f"{settings['threshold']} steps")
        # A training step's groups come from the weights before it; validation runs on the weights of its step.
        newest = step - 1 if partition == "train" else step
        if not tags["min_global_steps"] <= tags["max_global_steps"] <= newest:
            problems.append(f"{where}: {key} generated on weights {tags['min_global_steps']}.."
                            f"{tags['max_global_steps']}, newer than {newest}")
    # The selection is the sampler's clear of the chosen prompts, made within the call (verl's and ours alike).
    selections = [clear for clear in clears if clear["by"] == "sampler" and clear["partition"] == partition
                  and call["t0"] <= clear["t"] <= call["t1"] and set(groups) & set(clear["keys"])]
    if len(selections) != 1:
        return problems + [f"{where}: {len(selections)} clears of its groups' prompts within the call, not one"]
    selection = selections[0]
    selected = {key for key in selection["keys"] if "_" not in key}
    if set(groups) - selected or len(selected) != size:
        problems.append(f"{where}: {len(selected)} groups selected ({size} asked); handed out without a "
                        f"selection: {sorted(set(groups) - selected)}")
    seen = handed.setdefault(partition, set())
    for uid in sorted(selected):
        if uid in seen:
            problems.append(f"{where}: group {uid} handed out twice")
        seen.add(uid)
        status = selection.get("prompt_tags", {}).get(uid, {}).get("status")
        if status not in ("finished", "failure"):
            problems.append(f"{where}: group {uid} handed out while its prompt was {status!r}")
        stored = selection.get("store_trajectories", {}).get(uid, [])
        if sorted(groups.get(uid, [])) != stored:
            problems.append(f"{where}: group {uid} handed out with {sorted(groups.get(uid, []))}, the store held "
                            f"{stored}")
        n = settings["n"] if partition == "train" else settings["val_n"]
        if status == "finished" and stored != sorted(f"{uid}_{i}_0" for i in range(n)):
            problems.append(f"{where}: finished group {uid} has trajectories {stored}")
    return problems


def _check_accounting(record: dict[str, Any], handed: dict[str, set[str]]) -> list[str]:
    problems: list[str] = []
    final = record.get("final", {}).get("prompts", {})
    submitted: dict[str, list[str]] = {}
    for submit in record.get("submits", []):
        submitted.setdefault(submit["partition"], []).extend(submit["keys"])
    evicted: dict[str, set[str]] = {}
    for clear in record.get("clears", []):
        if clear["by"] == "sampler":
            evicted.setdefault(clear["partition"], set()).update(k for k in clear["keys"] if "_" not in k)
    for partition, keys in submitted.items():
        if len(keys) != len(set(keys)):
            problems.append(f"{partition}: a prompt was submitted twice")
        consumed = handed.get(partition, set())
        dropped = evicted.get(partition, set()) - consumed
        left = set(final.get(partition, {}))
        accounted = len(consumed) + len(dropped) + len(left)
        if set(keys) != consumed | dropped | left or accounted != len(set(keys)):
            problems.append(f"{partition}: {len(set(keys))} prompts submitted, {len(consumed)} consumed + "
                            f"{len(dropped)} evicted + {len(left)} left in the store = {accounted}; unaccounted "
                            f"{sorted(set(keys) - consumed - dropped - left)[:5]}, never submitted "
                            f"{sorted((consumed | dropped | left) - set(keys))[:5]}")
        reported = sum(value for call in record.get("calls", [])
                       if call.get("metrics") and _call_partition(call) == partition
                       for name, value in call["metrics"].items()
                       if name.endswith("/evicted_samples"))
        if reported != len(dropped):
            problems.append(f"{partition}: the sampler reported {reported} evictions and cleared {len(dropped)}")
    return problems


def _call_partition(call: dict[str, Any]) -> str:
    return str(_call_args(call, "global_steps", "partition_id")[1])


def _check_steps(record: dict[str, Any]) -> list[str]:
    settings = record["settings"]
    batches = [c for c in record.get("clears", []) if c["by"] == "trainer" and c["partition"] == "train"]
    samples = [c for c in record.get("calls", []) if c["kind"] == "sample" and _call_partition(c) == "train"]
    per_step = settings["parameter_sync_step"] if settings["mode"] == "separate_async" else 1
    problems = []
    if len(batches) != settings["steps"] or len(samples) != settings["steps"] * per_step:
        problems.append(f"{len(batches)} steps cleared and {len(samples)} batches sampled, expected "
                        f"{settings['steps']} and {settings['steps'] * per_step}")
    for i, clear in enumerate(batches):
        sampled = {key for call in samples[i * per_step:(i + 1) * per_step] for key in call.get("keys", [])}
        if sampled - set(clear["keys"]):
            problems.append(f"step {i + 1}: the trainer did not clear {sorted(sampled - set(clear['keys']))[:5]}")
    return problems
