"""Records the wire cannot carry, in a real TransferQueue, against buffer.verl (run inside the store host).

verl's own sampler reads such a record in-process; the product's poller must
quarantine it (or convert it) and keep every other group flowing.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from buffer.verl import ReplayBufferAsync
from poller.sources.transferqueue import source_kwargs
from tests.integration.verl_scenarios import POLL, group, listed, uids_of


def _poison(pid: str) -> dict[str, str]:
    """Rollout-worker records: one converts (numpy/torch scalars), the others cannot go on the wire."""
    import numpy as np
    import torch
    import transfer_queue as tq

    names = {"converts": f"np-{uuid.uuid4().hex[:6]}", "big_int": f"big-{uuid.uuid4().hex[:6]}",
             "int_tag_name": f"name-{uuid.uuid4().hex[:6]}", "complex": f"z-{uuid.uuid4().hex[:6]}"}
    # A whole group whose prompt's tags are numpy and torch scalars: it must be sampled like any other.
    tq.kv_put(key=f"{names['converts']}_0_0", partition_id=pid, fields={"input_ids": torch.tensor([1])},
              tag={"status": "success", "global_steps": np.int64(0), "reward": np.float32(0.5)})
    tq.kv_put(key=names["converts"], partition_id=pid,
              tag={"is_prompt": True, "status": "finished", "global_steps": np.int64(0), "score": torch.tensor(1.0)})
    tq.kv_put(key=names["big_int"], partition_id=pid, tag={"status": "success", "global_steps": 0, "seed": 2**70})
    tq.kv_put(key=names["int_tag_name"], partition_id=pid, tag={7: "x", "status": "success"})
    tq.kv_put(key=names["complex"], partition_id=pid, tag={"z": np.complex64(1 + 2j)})
    return names


def _quarantined(rb: ReplayBufferAsync, pid: str) -> list[str]:
    return sorted(key for partition, key, _ in rb.stats()["quarantined_keys"] if partition == pid)


def async_with_poison(conf: Any, *, before_start: bool) -> dict[str, Any]:
    """ReplayBufferAsync samples good groups (and the converted one) while three records are quarantined."""
    import transfer_queue as tq

    pid = f"p-{uuid.uuid4().hex[:8]}"
    good = [group(pid, "finished", step=0) for _ in range(2)]
    names = _poison(pid) if before_start else {}
    rb = ReplayBufferAsync(trainer_mode="colocate_async", trainer_config={}, max_off_policy_threshold=4,
                           max_off_policy_strategy="drop",
                           sampler_kwargs={"source_kwargs": source_kwargs(conf), "poll_interval": POLL,
                                           "sample_timeout": 60})
    try:
        assert rb.get_sampleable_count(global_steps=0, partition_id=pid) == (3 if before_start else 2)
        if not before_start:
            names = _poison(pid)
        later = group(pid, "finished", step=0)  # written after the poison: it must arrive
        batch, _ = rb.sample(global_steps=0, partition_id=pid, batch_size=4)
        sampled = uids_of(batch.keys)
        assert sampled == {*good, later, names["converts"]}, (sampled, names)
        deadline = time.monotonic() + 10  # the count rides on the poller's heartbeats (every second)
        while len(_quarantined(rb, pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = rb.stats()
        quarantined = _quarantined(rb, pid)
        assert quarantined == sorted([names["big_int"], names["int_tag_name"], names["complex"]]), stats
        assert stats["restarts"] == 0 and stats["source_errors"] == 0 and stats["poller_alive"]
        # Cleared in the store, the records leave the quarantine with the next call's listing (as verl's
        # sampler, buffer.verl lists nothing between calls).
        tq.kv_clear(keys=[names["big_int"], names["int_tag_name"], names["complex"]], partition_id=pid)
        rb.get_sampleable_count(global_steps=0, partition_id=pid)
        deadline = time.monotonic() + 10
        while _quarantined(rb, pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"sampled": len(sampled), "quarantined": quarantined, "left_after_clear": _quarantined(rb, pid)}
    finally:
        rb.close()
        tq.kv_clear(keys=list(listed(pid)), partition_id=pid)
