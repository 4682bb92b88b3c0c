"""A process that does a poller's kind of work at a poller's CPU share, and nothing else: no buffer, no socket.

The floor of #1: a trainer's main thread beside it pays only for sharing the
machine (cores, caches, memory bandwidth) with a busy process, never for a
buffer. Each period it compares two dicts of ``keys`` small tag dicts (what a
poller's diff does), as many slices as take ``share`` of the period on a
core of its own, then sleeps the rest (none when a busy core made the work
take longer: the next period starts at once, as a poller's next poll does).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

_CODE = """
import sys, time
keys, share, period = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
# In slices of 5000 keys, so the share is kept to within one slice's compare (~1 ms).
lefts = [{f"k{i}": {"global_steps": 1, "status": "success", "reward": i / 7, "length": i % 900, "score": i % 7}
          for i in range(start, min(start + 5000, keys))} for start in range(0, keys, 5000)]
rights = [{key: dict(tags) for key, tags in left.items()} for left in lefts]
# The CPU of one compare, in CPU time (which a busy core does not stretch): each period then does the work
# the share buys, however long a busy core makes it take, as a poller's poll does its diff (a neighbour that
# stopped at a wall-clock deadline did less work than the poller it stands for on a core shared with others).
started, n = time.thread_time(), 0
while n < 2 * len(lefts) or time.thread_time() - started < 0.05:
    lefts[n % len(lefts)] == rights[n % len(rights)]
    n += 1
per_compare = (time.thread_time() - started) / n
print("ready", flush=True)
budget, n = 0.0, 0
while True:
    began = time.perf_counter()
    budget += share * period / per_compare
    while budget >= 1:
        lefts[n % len(lefts)] == rights[n % len(rights)]
        n += 1
        budget -= 1
    time.sleep(max(0.0, began + period - time.perf_counter()))
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Neighbour:
    """The busy process; ``close()`` ends it."""

    def __init__(self, keys: int, share: float, period: float = 0.1) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _CODE, str(keys), f"{share:.4f}", str(period)],
                                      stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        # Building its dicts takes well under a second; a child that never says so is not waited for.
        ready, _, _ = select.select([self._proc.stdout], [], [], 60.0)
        if not ready or self._proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the neighbour process did not start within 60 s")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
        self._proc.wait(timeout=30)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
