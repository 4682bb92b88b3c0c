"""A verl v1-shaped trainer using ``buffer.verl`` as its custom sampler, on SQLite or TransferQueue.

It follows verl's ``PPOTrainer`` where the sampler is concerned::

    store init ─▶ Trainer(config): builds the sampler from trainer.v1.sampler.custom_sampler
               ─▶ fit: per step, submit prompts (pending) ─▶ sample(global_steps, "train", batch_size)
                       ─▶ "train" ─▶ clear the batch's trajectory keys
               ─▶ finally: store close (TransferQueue: tq.close()); the sampler is never closed

The agent loop (a thread on SQLite, Ray tasks on TransferQueue) writes the
way verl's does: the prompt goes running, each session's trajectory is put
with its reward in ``extra_fields``, then the prompt turns finished (or
failure). ``refill_fn`` submits prompts synchronously, as verl's
``_add_prompts_to_generate``. verl never closes its sampler: here its
finalizer stops the poller at exit, after ``tq.close()``.

Run it from the repository root::

    .venv/bin/python examples/verl_v1_trainer.py --store sqlite [--mode sync|colocate_async] [--steps 3]
    .venv/bin/python examples/verl_v1_trainer.py --store transferqueue     # make test-integration installs it

It prints one JSON line per event and exits 0 (1 with the trainer's own
traceback when ``--fail-init`` makes the constructor raise after building the sampler).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import queue
import random
import shutil
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from poller.sources.sqlite import SqliteSource  # noqa: E402


def agent_loop(store: Any, partition_id: str, uid: str, step: int, sessions: int, seed: int) -> None:
    """One prompt's rollout, written as verl's agent loop writes it."""
    rng = random.Random(seed)
    store.kv_put(uid, partition_id, tag={"status": "running"})
    failed = rng.random() < 0.2
    for session in range(sessions - 1 if failed else sessions):
        reward = float(rng.random() < 0.5)
        store.kv_put(f"{uid}_{session}_0", partition_id,
                     fields={"extra_fields": {"reward_extra_info": {"acc": reward}}},
                     tag={"status": "success", "global_steps": step, "seq_len": 16})
    store.kv_put(uid, partition_id, tag={"status": "failure" if failed else "finished"})


def _tq_rollout(partition_id: str, jobs: list[tuple[str, int, int, int]]) -> None:
    """Ray task: attaches to the running TransferQueue and runs the agent loops."""
    import transfer_queue as tq

    tq.init()
    for uid, step, sessions, seed in jobs:
        agent_loop(tq, partition_id, uid, step, sessions, seed)


class SqliteRollout:
    """The agent loop as a thread writing into the SQLite store."""

    def __init__(self, path: str) -> None:
        self.jobs: queue.Queue[tuple[str, int, int, int] | None] = queue.Queue()
        self.store = SqliteSource(path)
        self.thread = threading.Thread(target=self._run, name="agent-loop", daemon=True)
        self.thread.start()

    def submit(self, partition_id: str, jobs: list[tuple[str, int, int, int]]) -> None:
        for job in jobs:
            self.jobs.put(job)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            agent_loop(self.store, "train", *job)

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(30)
        self.store.close()


class TransferQueueRollout:
    def __init__(self) -> None:
        import ray

        self.remote = ray.remote(num_cpus=1)(_tq_rollout)
        self.pending: list[Any] = []

    def submit(self, partition_id: str, jobs: list[tuple[str, int, int, int]]) -> None:
        self.pending.append(self.remote.remote(partition_id, jobs))

    def stop(self) -> None:
        import ray

        ray.get(self.pending, timeout=120)


def load_sampler_class(path: str, name: str) -> Any:
    """verl's ``load_extern_type`` for a ``pkg://`` path."""
    assert path.startswith("pkg://")
    return getattr(importlib.import_module(path[len("pkg://"):].replace("/", ".")), name)


class Trainer:
    """The sampler-facing part of verl's v1 ``PPOTrainer``."""

    def __init__(self, config: dict[str, Any], client: Any, rollout: Any, *, fail_init: bool = False) -> None:
        self.config = config
        self.client = client  # the trainer's store calls (tq module / SQLite)
        self.rollout = rollout
        self.global_steps = 1
        self.seed = 0
        sampler = config["sampler"]
        sampler_cls = load_sampler_class(sampler["custom_sampler"]["path"], sampler["custom_sampler"]["name"])
        # verl's _build_replay_buffer, custom path: keywords only.
        self.replay_buffer = sampler_cls(trainer_mode=config["trainer_mode"], trainer_config={},
                                         max_off_policy_threshold=sampler["max_off_policy_threshold"],
                                         max_off_policy_strategy=sampler["max_off_policy_strategy"],
                                         sampler_kwargs=sampler["sampler_kwargs"],
                                         refill_fn=self._add_prompts_to_generate)
        if fail_init:
            raise RuntimeError("trainer init failed (--fail-init): e.g. a model that does not load")

    def _add_prompts_to_generate(self, num_prompts: int) -> int:
        """verl's refill_fn: register prompts as pending (synchronously), then dispatch them."""
        uids = [uuid.uuid4().hex for _ in range(num_prompts)]
        tags = [{"is_prompt": True, "status": "pending", "global_steps": self.global_steps} for _ in uids]
        self.client.kv_batch_put(keys=uids, partition_id="train", tags=tags)
        jobs = []
        for uid in uids:
            self.seed += 1
            jobs.append((uid, self.global_steps, self.config["sessions"], self.seed))
        self.rollout.submit("train", jobs)
        return num_prompts

    def fit(self) -> None:
        seen: set[str] = set()
        batch_size = self.config["train_batch_size"]
        for step in range(1, self.config["steps"] + 1):
            self.global_steps = step
            self._add_prompts_to_generate(batch_size)                         # prepare_step
            batch, metrics = self.replay_buffer.sample(global_steps=step, partition_id="train",
                                                       batch_size=batch_size)
            uids = {key.split("_")[0] for key in batch.keys}
            if len(uids) != batch_size or uids & seen or len(batch.tags) != len(batch.keys):
                raise RuntimeError(f"step {step}: a bad batch: {sorted(uids)} (seen before: {sorted(uids & seen)})")
            seen |= uids
            # ... old_log_prob, advantages, the actor update would go here ...
            self.client.kv_clear(keys=list(batch.keys), partition_id="train")   # 7. cleanup
            _event("step", step=step, groups=len(uids), trajectories=len(batch.keys),
                   metrics={k: v for k, v in metrics.items() if not k.startswith("_")},
                   poller_pid=self.replay_buffer.stats()["poller_pid"])


def _event(name: str, **fields: Any) -> None:
    print(json.dumps({"event": name, **fields}), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", choices=("sqlite", "transferqueue"), default="sqlite")
    parser.add_argument("--mode", default="sync", help="trainer_mode: sync, or any async mode")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--poll-interval", type=float, default=0.05)
    parser.add_argument("--fail-init", action="store_true", help="make the trainer's constructor raise")
    args = parser.parse_args(argv)

    temp_dir = tempfile.mkdtemp(prefix="verl-v1-", dir="/tmp")
    try:
        _run(args, temp_dir)
        # The trainer and its sampler are unreachable now (refill_fn ties them in a cycle, as in verl):
        # collecting them runs the sampler's finalizer, which stops the poller. At exit it would too.
        gc.collect()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return 0


def _run(args: argparse.Namespace, temp_dir: str) -> None:
    sampler_kwargs: dict[str, Any] = {"poll_interval": args.poll_interval, "sample_timeout": 120}
    if args.store == "sqlite":
        path = str(Path(temp_dir) / "kv.db")
        client: Any = SqliteSource(path)
        rollout: Any = SqliteRollout(path)
        sampler_kwargs.update(source="poller.sources.sqlite:SqliteSource", source_kwargs={"path": path})
    else:
        from examples.verl_style_trainer import start_store

        start_store(temp_dir=temp_dir)                                        # 1. store init (tq.init)
        import transfer_queue as tq

        client, rollout = tq, TransferQueueRollout()
    config = {"trainer_mode": args.mode, "steps": args.steps, "train_batch_size": args.batch_size,
              "sessions": args.sessions,
              "sampler": {"max_off_policy_threshold": 2, "max_off_policy_strategy": "drop",
                          "custom_sampler": {"path": "pkg://buffer.verl", "name": "ReplayBuffer"},
                          "sampler_kwargs": sampler_kwargs}}
    try:
        trainer = Trainer(config, client, rollout, fail_init=args.fail_init)  # 2. trainer (builds the sampler)
        _event("trainer-built", sampler=type(trainer.replay_buffer).__name__)
        trainer.fit()                                                         # 3. fit
        _event("fit-done", stats={k: v for k, v in trainer.replay_buffer.stats().items()
                                  if k in ("decisions", "syncs", "refills", "batches", "poller_alive")})
    finally:
        # verl's finally: the store goes; the sampler is never closed.
        rollout.stop()
        if args.store == "sqlite":
            client.close()
        else:
            from examples.verl_style_trainer import stop_store

            stop_store()                                                      # 4. tq.close(), ray.shutdown()
        _event("store-closed")


if __name__ == "__main__":
    sys.exit(main())
