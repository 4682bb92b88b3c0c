"""Processes in tests: facts from Linux's /proc (is a pid running, its children), and running a few to their end."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence

from poller.common.procfs import state

__all__ = ["children_of", "close_from_threads", "is_running", "run_to_the_end"]


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    return state(pid) not in (None, "Z")


def children_of(pid: int) -> set[int]:
    """Live (non-zombie) children of ``pid``."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                # After the command name, which may hold spaces and parentheses: state, parent pid.
                status, parent = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue  # not a process, or gone
        if status != "Z" and int(parent) == pid:
            found.add(int(entry))
    return found


def run_to_the_end(procs: Sequence[Any], timeout: float, started: Callable[[], None] | None = None) -> list[Any]:
    """Start ``procs`` (``multiprocessing`` processes), call ``started``, join each within ``timeout``;
    return their exit codes. Whatever is still running then is killed, and every one is closed."""
    try:
        for proc in procs:
            proc.start()
        if started is not None:
            started()
        for proc in procs:
            proc.join(timeout)
        return [proc.exitcode for proc in procs]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
            proc.close()


def close_from_threads(closeable: Any, threads: int, timeout: float) -> list[Any]:
    """What ``closeable.close()`` returned in each of ``threads`` threads calling it at once."""
    reports: list[Any] = []
    callers = [threading.Thread(target=lambda: reports.append(closeable.close())) for _ in range(threads)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout)
    return reports
