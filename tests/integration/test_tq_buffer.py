"""The buffer on a real TransferQueue: what the trainer sees of puts, merges,
clears and both sample modes, with verl's tags."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from buffer import ReplayBuffer
from poller.sources.transferqueue import SPEC
from tests.conftest import wait_until
from tests.test_transferqueue_source import heavy_modules_after

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

POLL = 0.05


def buffer_on(store: Any, **kwargs: Any) -> ReplayBuffer:
    # No listing share: these tests are about what the buffer holds and samples, and their short
    # timeouts assume a listing every POLL (by default the next comes 2 s after one ends).
    return ReplayBuffer(SPEC, source_kwargs=store.call("kwargs", **kwargs), poll_interval=POLL, listing_share=1.0)


def test_the_poller_process_holds_no_transferqueue_ray_or_torch(store):
    assert importlib.util.find_spec("transfer_queue") is not None  # installed here, so the checks mean something
    assert heavy_modules_after("import poller, buffer, poller.sources.transferqueue") == []
    with buffer_on(store) as rb:
        maps = Path(f"/proc/{rb.stats()['poller_pid']}/maps").read_text()
    assert "torch" not in maps and "_raylet" not in maps and "transfer_queue" not in maps


def test_source_kwargs_from_init_and_from_ray_agree(store):
    from_conf = store.call("kwargs")
    assert store.call("kwargs", from_ray=True) == from_conf
    assert from_conf["address"].startswith("tcp://127.0.0.1:")


def test_a_put_becomes_visible_and_tag_only_puts_merge(store, partition):
    with buffer_on(store) as rb:
        store.call("put", "k1", partition, {"global_steps": 1, "status": "running"}, with_fields=True)
        assert wait_until(lambda: rb.snapshot(partition).get("k1") == {"global_steps": 1, "status": "running"})
        store.call("put", "k1", partition, {"status": "success"})  # a tag-only put: no data
        assert wait_until(lambda: rb.snapshot(partition).get("k1") == {"global_steps": 1, "status": "success"})
        store.call("batch_put", ["k2", "k3"], partition, [{"score": 0.5}, {"score": 1.5, "status": "failure"}],
                   with_fields=True)
        # kv_list() passes through unchanged: the buffer holds what the store lists. (A batch put
        # lists its keys before their tags, so a poll in between sees {} for a moment.)
        listed = store.call("list", partition)[partition]
        assert len(listed) == 3 and listed["k3"] == {"score": 1.5, "status": "failure"}
        assert wait_until(lambda: rb.snapshot(partition) == listed)


def test_a_cleared_key_is_gone_and_a_removed_key_is_not_resurrected(store, partition):
    with buffer_on(store) as rb:
        store.call("batch_put", ["a", "b"], partition, [{"status": "success"}, {"status": "success"}])
        assert wait_until(lambda: set(rb.snapshot(partition)) == {"a", "b"})
        polls = rb.stats()["messages"]
        rb.remove(partition, ["a"])  # consumed; the store still lists it for a while
        assert wait_until(lambda: rb.stats()["messages"] >= polls + 10)
        assert "a" not in rb.snapshot(partition)
        store.call("clear", ["a"], partition)
        store.call("clear", ["b"], partition)  # cleared in the store: gone from the buffer
        assert wait_until(lambda: rb.snapshot(partition) == {})
        polls = rb.stats()["messages"]
        assert wait_until(lambda: rb.stats()["messages"] >= polls + 10)
        assert rb.snapshot(partition) == {}
        store.call("put", "a", partition, {"status": "success"})  # written again: new again
        assert wait_until(lambda: rb.snapshot(partition) == {"a": {"status": "success"}})


def test_sample_by_step_with_verls_tags(store, partition):
    with buffer_on(store) as rb:
        rows = ["r0", "r1", "r2", "r3"]
        rb.add(partition, {k: {"global_steps": 3, "status": "running"} for k in rows})  # the trainer's markers
        # The workers' results carry no global_steps; they are merged into the markers.
        store.call("batch_put", rows[:3], partition, [{"status": "success"}, {"status": "finished"},
                                                      {"status": "failure"}], with_fields=True)
        with pytest.raises(TimeoutError, match=r"1 key\(s\) of step 3 still 'running' \(r3\)"):
            rb.sample(partition, global_steps=3, timeout=1.0)
        store.call("put", "r3", partition, {"status": "success"}, with_fields=True)
        batch = rb.sample(partition, global_steps=3, timeout=60)
        assert batch.keys == ["r0", "r3"]
        assert batch.tags == [{"global_steps": 3, "status": "success"}] * 2
        assert rb.sample(partition, global_steps=4, timeout=1).keys == []  # no rows of that step at all


def test_sample_by_batch_size(store, partition):
    with buffer_on(store) as rb:
        store.call("batch_put", ["x0", "x1", "x2"], partition,
                   [{"status": "success"}, {"status": "running"}, {"status": "success"}])
        with pytest.raises(TimeoutError, match="only 2 of 3 'success'"):
            rb.sample(partition, batch_size=3, timeout=1.0)
        store.call("put", "x1", partition, {"status": "success"})
        assert rb.sample(partition, batch_size=3, timeout=60).keys == ["x0", "x1", "x2"]
        assert rb.sample(partition, batch_size=2, timeout=60).keys == ["x0", "x1"]


def test_polling_can_be_restricted_to_some_partitions(store, partition):
    other = partition + "-other"
    with buffer_on(store, partition_ids=[partition, partition + "-never-written"]) as rb:
        store.call("put", "mine", partition, {"status": "success"})
        store.call("put", "theirs", other, {"status": "success"})
        assert wait_until(lambda: "mine" in rb.snapshot(partition))
        polls = rb.stats()["messages"]
        assert wait_until(lambda: rb.stats()["messages"] >= polls + 10)
        assert rb.snapshot() == {partition: {"mine": {"status": "success"}}}
        assert rb.stats()["source_errors"] == 0


def test_a_release_outside_the_tested_range_starts_on_the_real_controller_with_one_warning(store, partition, caplog):
    # What verl users run: TransferQueue from git main. Its controller answers the probe in the known shape.
    caplog.set_level("WARNING")
    kwargs = {**store.call("kwargs"), "controller_version": "0.1.12.dev0"}
    with ReplayBuffer(SPEC, source_kwargs=kwargs, poll_interval=POLL) as rb:
        store.call("put", "k1", partition, {"status": "success"})
        assert wait_until(lambda: "k1" in rb.snapshot(partition))
    warnings = [r.getMessage() for r in caplog.records if "0.1.12.dev0" in r.getMessage()]
    assert len(warnings) == 1 and "is not a release this poller was tested with (0.1.8 to 0.1.11)" in warnings[0]
