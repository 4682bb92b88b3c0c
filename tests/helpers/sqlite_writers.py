"""Store writers for the change-feed tests, run in spawned children.

Kept apart from the test modules: a spawned child imports the module of its
target, and the test modules import ``tests.conftest``, which makes a
temporary directory at import.
"""

from __future__ import annotations

import random
from typing import Any

from poller.sources.sqlite import SqliteSource

JOIN_TIMEOUT = 60.0


def _tags(rng: random.Random, back: bool) -> dict[str, Any]:
    # Every put writes the same tag names: the buffer merges upserts into the
    # tags it holds (as add() does), so a key cleared and put again with fewer
    # names would keep the old ones there, through a listing as through the
    # change feed, and the buffer could not equal the store.
    return {"s": rng.randrange(3), "g": rng.randrange(2), "back": back}


def random_ops(store: SqliteSource, rng: random.Random, n: int) -> None:
    for _ in range(n):
        partition = rng.choice(["train", "val", "p3"])
        keys = [f"k{rng.randrange(40)}" for _ in range(rng.randrange(1, 6))]
        roll = rng.random()
        if roll < 0.6:
            store.kv_batch_put(keys, partition, tags=[_tags(rng, False) for _ in keys])
        elif roll < 0.9:
            store.kv_clear(keys, partition)
        else:  # cleared and put again between two polls
            store.kv_clear(keys, partition)
            store.kv_batch_put(keys, partition, tags=[_tags(rng, True) for _ in keys])


def open_and_put(path: str, index: int, gate: Any) -> None:
    """Child: one of several processes opening an old-schema file at once."""
    if not gate.wait(JOIN_TIMEOUT):
        raise SystemExit(3)
    with SqliteSource(path) as source:
        source.kv_put(f"new{index}", "p", tag={"index": index})


def random_writer(path: str, seed: int, ops: int) -> None:
    """Child: puts, clears and clear-then-put on keys the other writers touch too."""
    rng = random.Random(seed)
    with SqliteSource(path, timeout=30.0) as store:
        random_ops(store, rng, ops)
