"""The TransferQueue-shaped workload of ``python -m bench --only verl``, on the embedded SQLite store.

Keys as verl's agent loop writes them: a prompt key ``{uid}`` with tags
``is_prompt: True``, ``status`` (pending/running/finished/failure) and
``global_steps``, and its trajectories ``{uid}_{session}_{i}``. A store of K
keys holds K / 5 groups of 4 trajectories, all in flight (``running``).

The rollout side is a :class:`Rollouts` process with its own connection to
the store: told to, it finishes groups on a schedule (a few equal chunks at
fixed gaps; per chunk the trajectories first, then the prompts' status, as
verl's agent loop does) and reports the monotonic time of the commit that
made the last group terminal; it clears consumed keys and writes
new groups in their place, so K stays the same; and it can keep changing
trajectories in the background (rollouts making progress) for the slowdown
measurement.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from typing import Any

from poller.sources.sqlite import SqliteSource

SESSIONS = 4
KEYS_PER_GROUP = 1 + SESSIONS
PARTITION = "train"


def uid_of(n: int) -> str:
    return f"u{n:09d}"


def trajectory_keys(uid: str) -> list[str]:
    return [f"{uid}_{session}_0" for session in range(SESSIONS)]


def _write_groups(store: SqliteSource, uids: list[str], step: int) -> None:
    keys, tags = [], []
    for uid in uids:
        keys.append(uid)
        tags.append({"is_prompt": True, "status": "running", "global_steps": step})
        for key in trajectory_keys(uid):
            keys.append(key)
            tags.append({"status": "running", "global_steps": step})
    for start in range(0, len(keys), 20_000):
        store.kv_batch_put(keys[start:start + 20_000], PARTITION, tags=tags[start:start + 20_000])


def fill(path: str, groups: int) -> None:
    """A fresh store of ``groups`` running groups (uids 0 .. groups-1), at step 0."""
    with SqliteSource(path) as store:
        store.kv_list()
        for start in range(0, groups, 10_000):
            _write_groups(store, [uid_of(n) for n in range(start, min(groups, start + 10_000))], 0)


def _serve(path: str, conn: Any, seed: int) -> None:
    rng = random.Random(seed)
    with SqliteSource(path) as store:
        conn.send("ready")
        while True:
            command, args = conn.recv()
            if command == "quit":
                return
            if command == "finish":
                uids, delay, chunks, gap = args
                start = time.monotonic() + delay
                size = -(-len(uids) // chunks)
                for n, first in enumerate(range(0, len(uids), size)):
                    time.sleep(max(0.0, start + n * gap - time.monotonic()))
                    chunk = uids[first:first + size]
                    trajectories = [key for uid in chunk for key in trajectory_keys(uid)]
                    store.kv_batch_put(trajectories, PARTITION,
                                       tags=[{"status": "finished", "reward": rng.random()} for _ in trajectories])
                    store.kv_batch_put(list(chunk), PARTITION, tags=[{"status": "finished"} for _ in chunk])
                conn.send(time.monotonic())
            elif command == "replace":
                consumed, new_uids, step = args
                store.kv_clear(list(consumed), PARTITION)
                _write_groups(store, list(new_uids), step)
                conn.send("done")
            elif command == "churn":
                # Rollouts making progress: one trajectory's tags change every `every` s, until told to stop.
                uids, every = args
                n = 0
                while not conn.poll(every):
                    uid = uids[n % len(uids)]
                    store.kv_put(f"{uid}_{n % SESSIONS}_0", PARTITION, tag={"tokens": n})
                    n += 1
                conn.recv()  # the stop
                conn.send(n)


class Rollouts:
    """The rollout writers: a process with its own store connection, driven over a pipe."""

    def __init__(self, path: str, seed: int = 0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(path, child, seed), name="bench-rollouts", daemon=True)
        self._process.start()
        child.close()
        if not self._conn.poll(120):
            raise TimeoutError("the rollout process did not start")
        self._conn.recv()

    def finish(self, uids: list[str], delay: float, chunks: int = 1, gap: float = 0.0) -> None:
        """Finish ``uids`` in ``chunks`` equal commits, the first ``delay`` s from now, then one every ``gap`` s.

        :meth:`terminal_at` gives the time of the last commit.
        """
        self._conn.send(("finish", (uids, delay, chunks, gap)))

    def terminal_at(self, timeout: float) -> float:
        """The monotonic time at which the last group of the last :meth:`finish` turned terminal."""
        if not self._conn.poll(timeout):
            raise TimeoutError("the rollout process did not finish the groups")
        return float(self._conn.recv())

    def replace(self, consumed: list[str], new_uids: list[str], step: int, timeout: float = 120) -> None:
        """Clear ``consumed`` keys and write ``new_uids`` as running groups of ``step``."""
        self._conn.send(("replace", (consumed, new_uids, step)))
        if not self._conn.poll(timeout):
            raise TimeoutError("the rollout process did not replace the groups")
        self._conn.recv()

    def start_churn(self, uids: list[str], every: float) -> None:
        self._conn.send(("churn", (uids, every)))

    def stop_churn(self, timeout: float = 30) -> int:
        self._conn.send("stop")
        if not self._conn.poll(timeout):
            raise TimeoutError("the rollout process did not stop churning")
        return int(self._conn.recv())

    def close(self) -> None:
        try:
            self._conn.send(("quit", None))
        except OSError:
            pass
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()
