"""What a process started and left behind: child processes, threads, file descriptors, ipc directories.

``tests/conftest.py`` (its autouse ``no_leaks`` fixture) and ``python -m
bench.faults`` check every test and trial with it::

    before = leaks.snapshot()
    ...                                  # the code under test
    left = leaks.left_since(before)      # waits up to settle_s for what ends asynchronously
    assert not left, left.describe()

Not counted: ``multiprocessing``'s resource tracker (one per process, kept
for its lifetime by design), its pipe, and shared-memory or deleted files.
"""

from __future__ import annotations

import glob
import os
import tempfile
import threading
import time
from typing import NamedTuple

from tests.helpers.processes import children_of

__all__ = ["Resources", "snapshot", "left_since", "kill"]


class Resources(NamedTuple):
    """Child pids, live threads, open fds (as ``"fd->target"``) and ``replay-*`` ipc directories."""

    children: frozenset[int]
    threads: frozenset[threading.Thread]
    fds: frozenset[str]
    ipc_dirs: frozenset[str]

    def describe(self) -> str:
        parts = []
        if self.children:
            parts.append(f"child processes {sorted(self.children)}")
        if self.threads:
            parts.append(f"threads {sorted(t.name for t in self.threads)}")
        if self.fds:
            parts.append(f"fds {sorted(self.fds)}")
        if self.ipc_dirs:
            parts.append(f"ipc dirs {sorted(self.ipc_dirs)}")
        return "; ".join(parts)


def _tracker() -> tuple[int | None, int | None]:
    import multiprocessing.resource_tracker as rt

    return getattr(rt._resource_tracker, "_pid", None), getattr(rt._resource_tracker, "_fd", None)


def snapshot() -> Resources:
    """What this process holds now."""
    tracker_pid, tracker_fd = _tracker()
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        if tracker_fd is not None and fd == str(tracker_fd):
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (listdir's own fd among them)
        if not target.startswith("/dev/shm/") and "(deleted)" not in target:
            fds.add(f"{fd}->{target}")
    return Resources(frozenset(children_of(os.getpid()) - {tracker_pid}),
                     frozenset(t for t in threading.enumerate() if t.is_alive()), frozenset(fds),
                     frozenset(glob.glob(os.path.join(tempfile.gettempdir(), "replay-*"))))


def left_since(before: Resources, settle_s: float = 5.0) -> Resources:
    """What is held now and was not ``before``, after up to ``settle_s`` for it to end by itself."""
    deadline = time.monotonic() + settle_s
    while True:
        now = snapshot()
        left = Resources(now.children - before.children, now.threads - before.threads, now.fds - before.fds,
                         now.ipc_dirs - before.ipc_dirs)
        if not any(left) or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def kill(pids: frozenset[int]) -> None:
    """SIGKILL leftover children, so one leak does not spoil what runs next."""
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
