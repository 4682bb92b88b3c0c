"""Floors measured in the same run: what no poller can beat on this machine."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time


def _idle() -> None:
    time.sleep(60)


def bare_spawn() -> float:
    """A fresh interpreter that imports zmq and msgpack, start to exit."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import zmq, msgpack"], check=True)
    return time.perf_counter() - started


def kill_floor() -> float:
    """SIGKILL and reap of an idle spawned child."""
    child = multiprocessing.get_context("spawn").Process(target=_idle)
    child.start()
    time.sleep(0.05)
    started = time.perf_counter()
    child.kill()
    child.join()
    elapsed = time.perf_counter() - started
    child.close()
    return elapsed


def poller_kill(rb: object) -> float:
    """SIGKILL and reap of the idle poller of ``rb`` (a ReplayBuffer).

    The floor for ending a process of the poller's own size and threads;
    the buffer is left with a dead poller (close it after).
    """
    process = rb._core.process  # type: ignore[attr-defined]
    started = time.perf_counter()
    os.kill(process.pid, signal.SIGKILL)
    process.join(5)
    return time.perf_counter() - started
