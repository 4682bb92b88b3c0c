"""buffer.verl listing only its partitions, run inside the store host (where TransferQueue is live).

Each function takes ``tq.init()``'s config, writes the store as verl's agent loop does, asserts,
closes what it opened and returns observations for the test.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from typing import Any

from tests.helpers.sources import timed_listings
from tests.integration.verl_scenarios import _closed, custom_path, group


def wait_until(predicate: Any, timeout: float) -> bool:
    """Poll ``predicate`` until true or ``timeout``. (Not tests.conftest's: importing that module here,
    in the store host, would make the host a temporary directory of its own.)"""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return bool(predicate())
        time.sleep(0.02)
    return True


def _held_partitions(rb: Any) -> set[str]:
    """The partitions whose keys the sampler's buffer holds (every key listed comes in)."""
    return {partition for partition, counts in rb.stats()["groups"].items() if any(counts.values())}


def only_its_partitions(conf: Any) -> dict[str, Any]:
    train = group("train", "finished", step=1)
    val = group("val", "finished", step=0)
    for _ in range(3):  # another user's partition on the shared controller
        group("other", "finished", step=1)
    rb = custom_path("sync")
    batch, _ = rb.sample(global_steps=1, partition_id="train", batch_size=1)
    assert {key.split("_")[0] for key in batch.keys} == {train}
    assert _held_partitions(rb) == set(), rb.stats()["groups"]  # "train" handed out; nothing else came in
    group("train", "finished", step=2)
    assert rb.get_sampleable_count(2, "train") == 1
    assert _held_partitions(rb) == {"train"}, rb.stats()["groups"]
    # Validation: "val" joins the listing at its first call, and that call sees it at once.
    val_batch, _ = rb.sample(global_steps=9, partition_id="val", batch_size=1)
    assert {key.split("_")[0] for key in val_batch.keys} == {val}
    # A restarted poller lists "train" and "val" from its first listing, still not "other".
    group("val", "finished", step=0)
    stats = rb.stats()
    os.kill(stats["poller_pid"], signal.SIGKILL)
    assert wait_until(lambda: rb.stats()["snapshots"] > stats["snapshots"], timeout=60)
    assert _held_partitions(rb) == {"train", "val"}, rb.stats()["groups"]
    # Heartbeats carry the listing figures: wait for one of the restarted poller's after its first listing
    # (its first heartbeat, at start, reports none; the counters also sum the earlier process's).
    assert wait_until(lambda: rb.stats()["listing_seconds"] > 0, timeout=10)
    figures = {name: rb.stats()[name] for name in ("listings", "listing_seconds", "listing_seconds_total",
                                                   "listing_share")}
    _closed(rb)
    return {"figures": figures}


def partitions_given_are_kept(conf: Any) -> dict[str, Any]:
    from poller.sources.transferqueue import source_kwargs

    group("train", "finished", step=1)
    group("other", "finished", step=1)
    rb = custom_path("sync", source_kwargs=source_kwargs(conf, partition_ids=["train", "other"]))
    assert rb.get_sampleable_count(1, "train") == 1
    started = time.monotonic()
    assert wait_until(lambda: _held_partitions(rb) == {"train", "other"}, timeout=30), rb.stats()["groups"]
    _closed(rb)
    return {"waited_s": time.monotonic() - started}


def share_while_syncs_ask_every_20ms(conf: Any) -> dict[str, Any]:
    """A buffer on a real TransferQueue with the default listing share, asked to sync every 20 ms: when each
    listing began and ended (the source logs them) and what stats() said."""
    from buffer import ReplayBuffer
    from poller.sources.transferqueue import source_kwargs

    for _ in range(3):
        group("train", "finished", step=1)
    log = os.path.join(tempfile.mkdtemp(prefix="tq-listings-"), "listings.log")
    kwargs = {"log": log, **source_kwargs(conf, partition_ids=["train"])}
    stop, answered, errors = threading.Event(), [], []
    with ReplayBuffer("tests.helpers.sources:logged_transferqueue", source_kwargs=kwargs,
                      poll_interval=0.02) as rb:
        def ask() -> None:
            while not stop.is_set():
                try:
                    rb.sync(timeout=30)
                except BaseException as exc:  # noqa: BLE001 - returned to the test
                    errors.append(repr(exc))
                    return
                answered.append(1)
                stop.wait(0.02)

        asker = threading.Thread(target=ask, name="sync-every-20ms", daemon=True)
        asker.start()
        try:
            assert wait_until(lambda: len(timed_listings(log)) >= 4, timeout=60), timed_listings(log)
            assert wait_until(lambda: rb.stats()["listings"] >= 4, timeout=10)  # a heartbeat reported them
        finally:
            stop.set()
            asker.join(35)
        stats = rb.stats()  # once: the figures of one heartbeat
        figures = {name: stats[name] for name in ("listings", "listing_seconds", "listing_seconds_total",
                                                  "listing_share")}
    return {"listings": timed_listings(log), "answered": len(answered), "errors": errors, "figures": figures}


def watch_reads_named_keys_and_changes_nothing(conf: Any) -> dict[str, Any]:
    """kv_watch on the real controller: a fingerprint that moves with the keys named, and nothing created."""
    import numpy as np
    import torch
    import transfer_queue as tq

    from poller.sources.transferqueue import TransferQueueSource, source_kwargs

    running = group("train", "running", step=3)
    other = group("train", "running", step=3)
    # Values of every kind the listing decodes otherwise than msgpack does: read the same both ways.
    tq.kv_put(key=running, partition_id="train", tag={"n": np.int64(7), "x": np.float32(0.5),
                                                      "t": torch.tensor([1.0, 2.0]), "a": np.arange(3), "u": (1, 2)})
    source = TransferQueueSource(**source_kwargs(conf, partition_ids=["train"]))
    try:
        watch = [running]
        read = source.kv_watch("train", watch)
        listed = source.kv_list()["train"][running]
        assert read is not None and read.held() == (1, {running: listed}), (read.held(), listed)
        first = read.fingerprint
        assert source.kv_watch("train", watch).fingerprint == first
        both = source.kv_watch("train", [running, "never-put"])
        assert both.held() == (1, None)
        tq.kv_put(key=other, partition_id="train", tag={"status": "finished"})  # not watched
        unmoved = source.kv_watch("train", watch).fingerprint
        tq.kv_put(key=running, partition_id="train", tag={"status": "finished"})
        moved = source.kv_watch("train", watch).fingerprint
        tq.kv_clear(keys=[running], partition_id="train")
        removed = source.kv_watch("train", watch).fingerprint
        before = tq.kv_list()
        source.kv_watch("train", ["never-put"])
        source.kv_watch("no-such-partition", ["never-put"])
        after = tq.kv_list()
        return {"unmoved": unmoved == first, "moved": moved != first, "removed": removed != moved,
                "partitions_before": sorted(before), "partitions_after": sorted(after),
                "keys_before": sum(map(len, before.values())), "keys_after": sum(map(len, after.values()))}
    finally:
        source.close()
