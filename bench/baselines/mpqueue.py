"""What a user writes first: a child process puts the full listing on a
``multiprocessing.Queue`` (pickle) every poll; a trainer thread merges it."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from typing import Any

from . import merge_listing

Tags = dict[str, Any]


def _poll_forever(factory: Any, kwargs: dict[str, Any], q: Any, stop: Any, request: Any, interval: float) -> None:
    source = factory(**kwargs)
    while not stop.is_set():
        q.put(source.kv_list())
        request.wait(interval)  # a poll every interval, or at once when asked
        request.clear()


class MpQueueBuffer:
    def __init__(self, factory: Any, kwargs: dict[str, Any], poll_interval: float = 1.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._queue = ctx.Queue(maxsize=4)
        self._stop_child = ctx.Event()
        self._request = ctx.Event()
        self._process = ctx.Process(target=_poll_forever, daemon=True,
                                    args=(factory, kwargs, self._queue, self._stop_child, self._request,
                                          poll_interval))
        self.partitions: dict[str, dict[str, Tags]] = {}
        self.polls = 0
        self.items = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._process.start()
        self._thread = threading.Thread(target=self._run, name="mpqueue-baseline", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                listing = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            with self._lock:
                merge_listing(self.partitions, listing, copy=False)
                self.items += sum(map(len, listing.values()))
                self.polls += 1

    def poll_now(self) -> None:
        """Ask the child for a listing now."""
        self._request.set()

    def wait_polls(self, n: int, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while self.polls < n:
            if time.monotonic() > deadline or not self._process.is_alive():
                raise TimeoutError(f"the mpqueue baseline did not deliver {n} polls")
            time.sleep(0.001)

    def close(self) -> None:
        self._stop_child.set()
        self._request.set()
        self._stopping.set()
        self._thread.join(5)
        # Drain so the child's feeder thread can flush and exit.
        deadline = time.monotonic() + 5
        while self._process.is_alive() and time.monotonic() < deadline:
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        if self._process.is_alive():
            self._process.kill()
        self._process.join(5)
        self._process.close()
        self._queue.close()
        self._queue.join_thread()
