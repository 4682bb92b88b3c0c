"""The in-trainer poller thread, as verl had it after its shutdown fix.

An ``Event``-driven loop calls ``kv_list()`` in the trainer process, merges
the whole listing into a dict of dicts under a lock on every poll, and
``sample()`` re-scans and sleeps one interval between scans.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from . import merge_listing

Tags = dict[str, Any]


class ThreadBuffer:
    def __init__(self, kv_list: Callable[[], Any], poll_interval: float = 1.0) -> None:
        self._kv_list = kv_list
        self.poll_interval = poll_interval
        self.partitions: dict[str, dict[str, Tags]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.polls = 0
        self._thread = threading.Thread(target=self._run, name="thread-baseline-poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            listing = self._kv_list() or {}
            with self._lock:
                merge_listing(self.partitions, listing)
                self.polls += 1
            self._stop.wait(self.poll_interval)

    def add(self, partition_id: str, items: dict[str, Tags]) -> None:
        with self._lock:
            part = self.partitions.setdefault(partition_id, {})
            for key, tags in items.items():
                part.setdefault(key, {}).update(tags)

    def sample(self, partition_id: str, global_steps: Any, timeout: float | None = None) -> list[str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                items = self.partitions.get(partition_id, {})
                step = [(k, t) for k, t in items.items() if t.get("global_steps") == global_steps]
                if not any(t.get("status") == "running" for _, t in step):
                    return [k for k, t in step if t.get("status") == "success"]
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"sample({partition_id!r}, {global_steps!r})")
            time.sleep(self.poll_interval)

    def wait_polls(self, n: int, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while self.polls < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the thread baseline did not finish {n} polls")
            time.sleep(0.001)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.poll_interval + 1)
