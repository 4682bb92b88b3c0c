"""Start-up and close of an embedded poller, against floors measured in the same run.

    python -m bench.lifecycle [--repeat N]

Floors: a bare spawn of ``python -c "import zmq, msgpack"`` to exit, and
SIGKILL-and-reap of an idle spawned child. Medians of N repetitions.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Sequence

from buffer import ReplayBuffer
from poller.sources.sqlite import SqliteSource


def _idle() -> None:
    time.sleep(60)


class StuckAfterFirstPoll:
    """A source whose second ``kv_list()`` never returns (a store gone away)."""

    def __init__(self) -> None:
        self._calls = 0

    def kv_list(self) -> dict:
        self._calls += 1
        if self._calls > 1:
            threading.Event().wait()
        return {}


def _median(fn: Callable[[], float], repeat: int) -> float:
    return statistics.median(fn() for _ in range(repeat))


def bare_spawn() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import zmq, msgpack"], check=True)
    return time.perf_counter() - started


def kill_floor() -> float:
    child = multiprocessing.get_context("spawn").Process(target=_idle)
    child.start()
    time.sleep(0.05)
    started = time.perf_counter()
    child.kill()
    child.join()
    elapsed = time.perf_counter() - started
    child.close()
    return elapsed


def start_to_first_data(db: str) -> float:
    started = time.perf_counter()
    rb = ReplayBuffer(source="poller.sources.sqlite:SqliteSource", source_kwargs={"path": db}, poll_interval=1.0)
    assert rb.snapshot("train"), "the first listing was not applied"
    elapsed = time.perf_counter() - started
    rb.close()
    return elapsed


def close_idle(db: str) -> float:
    rb = ReplayBuffer(source="poller.sources.sqlite:SqliteSource", source_kwargs={"path": db}, poll_interval=1.0)
    report = rb.close()
    assert report.stage == "graceful", report
    return report.seconds


def close_stuck() -> float:
    rb = ReplayBuffer(source="bench.lifecycle:StuckAfterFirstPoll", poll_interval=0.01)
    time.sleep(0.05)
    report = rb.close()
    assert report.stage == "graceful", report
    return report.seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lifecycle", description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "kv.db")
        with SqliteSource(db) as store:
            store.kv_batch_put([f"k{i}" for i in range(1000)], "train",
                               tags=[{"global_steps": 1, "status": "success"}] * 1000)
        spawn = _median(bare_spawn, args.repeat)
        floor = _median(kill_floor, args.repeat)
        start = _median(lambda: start_to_first_data(db), args.repeat)
        idle = _median(lambda: close_idle(db), args.repeat)
        stuck = _median(close_stuck, args.repeat)
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}, {os.cpu_count()} cores, medians of {args.repeat}")
    print(f"{'figure':44} {'ms':>9} {'ratio':>8}")
    print(f"{'bare spawn: python -c import zmq, msgpack':44} {spawn * 1e3:9.1f} {'1.00':>8}")
    print(f"{'constructor start -> 1000 keys visible':44} {start * 1e3:9.1f} {start / spawn:7.2f}x  (vs bare spawn)")
    print(f"{'kill floor: SIGKILL + reap idle child':44} {floor * 1e3:9.1f} {'1.00':>8}")
    print(f"{'close(), idle poller (graceful)':44} {idle * 1e3:9.1f} {idle / floor:7.2f}x  (vs kill floor)")
    print(f"{'close(), kv_list() stuck (graceful)':44} {stuck * 1e3:9.1f} {stuck / floor:7.2f}x  (vs kill floor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
