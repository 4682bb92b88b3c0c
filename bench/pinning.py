"""Cores for #1: the trainer on one core, the process working beside it on another.

A trainer host has cores to spare for a poller; this machine has two, shared
with other work. Pinning the trainer process to one core and the poller (or
the process it is compared with) to the other keeps the two from queueing
for the same core, so the slowdown left is what the poller costs the
trainer through the GIL, caches and memory, not the competition for a core.

Linux sets affinity per thread (``sched_setaffinity`` on a pid moves only
the thread with that id), and a poller has started its threads and its
watchdog by the time the bench knows its pid: every thread of the process
and of its descendants is moved.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Collection, Iterator

from tests.helpers.processes import children_of


@dataclass(frozen=True)
class Placement:
    """Where #1 runs the trainer and the process beside it; both ``None`` when it cannot pin (``reason`` says why)."""

    trainer: frozenset[int] | None
    beside: frozenset[int] | None
    reason: str

    @property
    def pinned(self) -> bool:
        return self.trainer is not None


def plan(usable: Collection[int]) -> Placement:
    """The lowest usable core for the trainer, the next for what runs beside it; no pinning with fewer than 2."""
    cores = sorted(usable)
    if len(cores) < 2:
        return Placement(None, None, f"not pinned: {len(cores)} usable core(s) "
                                     f"({', '.join(map(str, cores)) or 'none'}); the loop and the process "
                                     "beside it share them")
    return Placement(frozenset({cores[0]}), frozenset({cores[1]}),
                     f"the trainer process (the loop and its other threads, which the GIL runs one at a time "
                     f"anyway) pinned to core {cores[0]}, the process beside it (all its threads and "
                     f"children) to core {cores[1]}")


def usable_cores() -> set[int]:
    """The cores this thread may run on."""
    return set(os.sched_getaffinity(0))


def threads_of(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (empty once it is gone)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def pin_tree(pid: int, cores: Collection[int]) -> int:
    """Move every thread of ``pid`` and of its descendants to ``cores``; returns how many were moved.

    A thread or process that ends meanwhile is skipped; threads started
    later inherit the mask of the thread that starts them.
    """
    moved, pending, seen = 0, [pid], set()
    while pending:
        process = pending.pop()
        if process in seen:
            continue
        seen.add(process)
        for tid in threads_of(process):
            try:
                os.sched_setaffinity(tid, cores)
                moved += 1
            except ProcessLookupError:
                pass
        pending.extend(children_of(process))
    return moved


@contextlib.contextmanager
def pinned_self(cores: Collection[int] | None) -> Iterator[None]:
    """Every thread of this process on ``cores`` inside the block, each put back on its own mask after.

    ``None`` leaves the affinities as they are. Threads started inside the
    block inherit the pinned mask; those still running after it keep it.
    """
    if cores is None:
        yield
        return
    before = {}
    for tid in threads_of(os.getpid()):
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:
            before.pop(tid, None)
    try:
        yield
    finally:
        for tid, mask in before.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, mask)
