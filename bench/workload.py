"""The verl-shaped workload every benchmark uses.

Partitions ``train`` and ``val``; K keys with flat tags (``global_steps``,
``status`` and three small numbers); C keys change per poll. The synthetic
source lives wherever it is built: inside the poller process for the product
and for ``mpqueue``, inside the trainer for ``thread`` (that is the point of
that baseline). A SQLite store with the same rows is the second source.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

Tags = dict[str, Any]
Listing = dict[str, dict[str, Tags]]

PARTITIONS = ("train", "val")


def make_tags(i: int, step: int = 1, status: str = "success") -> Tags:
    return {"global_steps": step, "status": status, "reward": (i % 97) / 97.0, "length": 100 + i % 900,
            "score": i % 7}


def key_of(i: int) -> str:
    return f"uid-{i:08d}"


def partition_of(i: int) -> str:
    # One key in ten is validation data, as in a verl run.
    return PARTITIONS[1] if i % 10 == 9 else PARTITIONS[0]


def make_listing(k: int) -> Listing:
    listing: Listing = {p: {} for p in PARTITIONS}
    for i in range(k):
        listing[partition_of(i)][key_of(i)] = make_tags(i)
    return listing


class StuckAfterFirstPoll:
    """A source whose second ``kv_list()`` never returns (a store gone away)."""

    def __init__(self) -> None:
        self._calls = 0

    def kv_list(self) -> dict:
        self._calls += 1
        if self._calls > 1:
            threading.Event().wait()
        return {}


class SyntheticSource:
    """``kv_list()`` over an in-memory listing of ``keys`` keys.

    Every call first changes ``changes`` keys (their ``reward`` and a bumped
    ``score``), round-robin, so the listing is new each poll the way a
    store's would be. With ``stamp_every`` > 0, a background thread instead
    changes one key every ``stamp_every`` seconds and writes the wall-clock
    time of the change into its tags (``t_changed``), which the trainer reads
    to time change -> visible.

    By default it hands out its own tag dicts (an in-memory store with no
    decoding, so the store's cost does not dominate any figure); with
    ``fresh=True`` it answers with new dicts each call, as an RPC client
    decoding a reply does. With ``answer_after`` > 0 each call answers that
    many seconds after it read the listing, as a store whose reply takes that
    long to arrive: every change it carries waits the whole of it.
    """

    def __init__(self, keys: int = 1000, changes: int = 0, stamp_every: float = 0.0, seed: int = 0,
                 fresh: bool = False, answer_after: float = 0.0) -> None:
        self.keys = keys
        self.changes = changes
        self.fresh = fresh
        self.answer_after = answer_after
        self._listing = make_listing(keys)
        self._cursor = 0
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        if stamp_every > 0:
            self._listing["stamps"] = {}
            thread = threading.Thread(target=self._stamp, args=(stamp_every,), daemon=True)
            thread.start()

    def _stamp(self, every: float) -> None:
        n = 0
        while True:
            # Random phase against the poll schedule.
            time.sleep(every * (0.5 + self._rng.random()))
            with self._lock:
                self._listing["stamps"][f"s{n:06d}"] = {"status": "success", "n": n, "t_changed": time.time()}
            n += 1

    def _change(self) -> None:
        for _ in range(self.changes):
            i = self._cursor % self.keys
            self._cursor += 1
            tags = self._listing[partition_of(i)][key_of(i)]
            tags["reward"] = self._rng.random()
            tags["score"] = tags["score"] + 1

    def kv_list(self) -> Listing:
        with self._lock:
            self._change()
            if not self.fresh:
                listing = {p: dict(items) for p, items in self._listing.items()}
            else:
                listing = {p: {k: dict(t) for k, t in items.items()} for p, items in self._listing.items()}
        if self.answer_after > 0:
            time.sleep(self.answer_after)  # outside the lock: the stamps go on meanwhile
        return listing


def fill_sqlite(path: str, keys: int) -> None:
    """Write ``keys`` rows of the workload into a SQLite store at ``path``."""
    from poller.sources.sqlite import SqliteSource

    listing = make_listing(keys)
    with SqliteSource(path) as store:
        for partition, items in listing.items():
            names = list(items)
            for start in range(0, len(names), 10000):
                chunk = names[start:start + 10000]
                store.kv_batch_put(chunk, partition, tags=[items[k] for k in chunk])


def rss_bytes(pid: int | None = None) -> int:
    with open(f"/proc/{pid or 'self'}/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
