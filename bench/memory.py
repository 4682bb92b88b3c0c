"""#8 full ``gc.collect()`` pause and #9 RSS per key, each in a fresh process.

    python -m bench.memory CONTENDER KEYS   # one probe; prints one JSON line

A fresh interpreter per probe, so one contender's garbage or freed-but-kept
heap never shows up in another's figures.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

from .report import Goal, Table, median
from .workload import make_listing, rss_bytes


def _probe(contender: str, keys: int) -> dict[str, Any]:
    from buffer import ReplayBuffer

    from .baselines.thread import ThreadBuffer
    from .overhead import SOURCE, wait_for

    gc.collect()
    before = rss_bytes()
    poller_rss = None
    if contender == "product":
        holder: Any = ReplayBuffer(source=SOURCE, source_kwargs={"keys": keys}, poll_interval=30.0,
                                   start_timeout=300)
        wait_for(lambda: holder.stats()["polls"] >= 1, 600, "the snapshot never arrived")
        assert holder.stats()["keys"] == keys
    else:
        # kv_list() builds a fresh listing per call, as an RPC client does:
        # what stays in the trainer is the buffer's own dict of dicts.
        holder = ThreadBuffer(lambda: make_listing(keys), poll_interval=30.0)
        holder.wait_polls(1)
    gc.collect()
    after = rss_bytes()
    pauses = []
    for _ in range(5):
        started = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - started)
    if contender == "product":
        deadline = time.monotonic() + 5
        while holder.stats()["poller_rss"] in (None, 0) and time.monotonic() < deadline:
            time.sleep(0.05)  # the first heartbeat carries it
        poller_rss = holder.stats()["poller_rss"]
    holder.close()
    return {"rss_per_key": (after - before) / keys, "gc_pause": median(pauses), "poller_rss": poller_rss,
            "tracked": len(gc.get_objects())}


def _run_probe(contender: str, keys: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.memory", contender, str(keys)], check=True,
                         capture_output=True, text=True, cwd=os.getcwd(),
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def gc_and_rss(progress: Callable[[str], None], quick: bool) -> list[Table]:
    keys = 200_000 if quick else 1_000_000
    results = {}
    for contender in ("product", "thread"):
        progress(f"memory: {contender} holding {keys:,} keys (fresh process)")
        results[contender] = _run_probe(contender, keys)
    gc_table = Table("8", f"full gc.collect() pause in the trainer process, K={keys:,}",
                     ["contender", "pause ms", "objects tracked by the GC"])
    rss_table = Table("9", f"RSS per key held, K={keys:,}", ["contender", "trainer bytes/key", "poller RSS MB",
                                                            "× thread"])
    for name, r in results.items():
        gc_table.add(name, r["gc_pause"] * 1e3, f"{r['tracked']:,}")
        rss_table.add(name, r["rss_per_key"], "-" if r["poller_rss"] is None else r["poller_rss"] / 1e6,
                      r["rss_per_key"] / results["thread"]["rss_per_key"])
    gc_table.goals.append(Goal("product pause ms", results["product"]["gc_pause"] * 1e3, 20.0))
    rss_table.goals.append(Goal("product / thread bytes per key",
                                results["product"]["rss_per_key"] / results["thread"]["rss_per_key"], 2.0))
    rss_table.notes.append("trainer RSS after the listing was applied minus before the buffer was built; "
                           "the product's figure includes its indexes by step and status and per-source bookkeeping")
    return [gc_table, rss_table]


if __name__ == "__main__":
    print(json.dumps(_probe(sys.argv[1], int(sys.argv[2]))))
