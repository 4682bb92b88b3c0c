"""A verl-style trainer on TransferQueue, with the replay buffer's poller in its own process.

The lifecycle, in this order::

    store init ─▶ buffer ─▶ trainer init (may fail) ─▶ fit ─▶ buffer close ─▶ store close

The buffer is closed before the store, and closed even when the trainer's
constructor raises: it is created by the code that also closes it, not inside
the trainer. Rollout workers (Ray tasks here) write each row's data and its
status (``success`` / ``finished`` / ``failure``, without ``global_steps``);
the trainer adds the ``running`` markers that carry the step, samples a step
once nothing in it is running, consumes it, and clears it from the store.

Run it from the repository root with the ``transferqueue`` extra installed
(``make test-integration`` puts it in ``.venv``)::

    .venv/bin/python examples/verl_style_trainer.py [--steps 3] [--rows 8] [--fail-init]

It prints one JSON line per event and exits 0, or 1 with the trainer's own
traceback when ``--fail-init`` makes the constructor raise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from buffer import ReplayBuffer  # noqa: E402
from poller.sources import transferqueue as tq_source  # noqa: E402

PARTITION = "train"
STATUSES = ("success", "success", "success", "finished", "failure")


def start_store(num_cpus: int = 4, temp_dir: str | None = None) -> Any:
    """``ray.init`` and ``tq.init`` sized for a small machine; returns ``tq.init()``'s config.

    ``temp_dir`` is Ray's session directory (default: under the system's
    temporary directory); its socket paths must stay under 108 bytes.
    """
    # Only loopback: Ray workers (where the controller runs) report
    # 127.0.0.1 instead of the host's address, so TransferQueue binds there.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import transfer_queue as tq

    # With TransferQueue's defaults a 2-core machine hangs silently in
    # init(): the controller and each of two storage units reserve a CPU.
    # Logical CPUs are only a scheduling count, and one storage unit is plenty.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 1024 * 1024, _node_ip_address="127.0.0.1", _temp_dir=temp_dir)
    try:
        return tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    except BaseException:
        ray.shutdown()
        raise


def stop_store() -> None:
    """``tq.close()`` then ``ray.shutdown()``: only the process that ran ``tq.init()`` may do this."""
    import ray
    import transfer_queue as tq

    try:
        tq.close()
    finally:
        ray.shutdown()


def rollout(partition_id: str, keys: list[str], seed: int) -> dict[str, str]:
    """A rollout worker (runs as a Ray task): data and a status per row, no ``global_steps``."""
    import torch
    import transfer_queue as tq

    tq.init()  # attaches to the running controller
    rng = random.Random(seed)
    statuses = {}
    for key in keys:
        statuses[key] = rng.choice(STATUSES)
        tq.kv_put(key, partition_id, fields={"responses": torch.randint(0, 100, (16,))},
                  tag={"status": statuses[key]})
    return statuses


class Trainer:
    """The part of a verl-style trainer that talks to the replay buffer."""

    def __init__(self, replay_buffer: ReplayBuffer, *, steps: int, rows: int, fail_init: bool = False) -> None:
        # verl built its thread-based buffer right here, as the first step:
        #     self.replay_buffer = ReplayBuffer(...)   # a poll thread in this process
        # and when a later step of __init__ raised, nothing ever closed it.
        # The buffer now comes from the caller, which closes it in a finally.
        self.replay_buffer = replay_buffer
        self.steps = steps
        self.rows = rows
        if fail_init:
            raise RuntimeError("trainer init failed (--fail-init): e.g. a model that does not load")

    def fit(self) -> None:
        import ray
        import transfer_queue as tq

        remote_rollout = ray.remote(num_cpus=1)(rollout)
        for step in range(1, self.steps + 1):
            keys = [f"step{step}-row{i}" for i in range(self.rows)]
            # The trainer's markers carry the step; the workers' tags do not,
            # and are merged into these as they arrive.
            self.replay_buffer.add(PARTITION, {k: {"global_steps": step, "status": "running"} for k in keys})
            written = remote_rollout.remote(PARTITION, keys, step)
            batch = self.replay_buffer.sample(PARTITION, global_steps=step, timeout=300)
            statuses = ray.get(written, timeout=300)
            expected = sorted(k for k, s in statuses.items() if s == "success")
            if sorted(batch.keys) != expected or any(t != {"global_steps": step, "status": "success"}
                                                     for t in batch.tags):
                raise RuntimeError(f"step {step}: sampled {batch.keys}, expected {expected}")
            # ... a training step on the batch's data would go here ...
            self.replay_buffer.remove(PARTITION, keys)
            tq.kv_clear(keys, PARTITION)
            _event("step", step=step, sampled=len(batch.keys), rows=len(keys))


def _event(name: str, **fields: Any) -> None:
    print(json.dumps({"event": name, **fields}), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--poll-interval", type=float, default=0.1)
    parser.add_argument("--fail-init", action="store_true", help="make the trainer's constructor raise")
    args = parser.parse_args(argv)

    conf = start_store()                                                   # 1. store init
    try:
        # The one-line swap: the buffer's poller is a child process that
        # lists the controller directly; the kwargs are plain data.
        replay_buffer = ReplayBuffer(tq_source.SPEC, source_kwargs=tq_source.source_kwargs(conf),
                                     poll_interval=args.poll_interval)    # 2. buffer
        _event("buffer-started", poller_pid=replay_buffer.stats()["poller_pid"])
        try:
            trainer = Trainer(replay_buffer, steps=args.steps, rows=args.rows,
                              fail_init=args.fail_init)                    # 3. trainer init
            trainer.fit()                                                  # 4. fit
            _event("fit-done", stats=replay_buffer.stats())
        finally:
            report = replay_buffer.close()                                 # 5. buffer close
            _event("buffer-closed", **report._asdict())
    finally:
        stop_store()                                                       # 6. store close
        _event("store-closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
