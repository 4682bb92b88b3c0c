"""One record the wire cannot carry, written to a real TransferQueue the way rollout workers write tags:
the buffer (TransferQueue source) and buffer.verl keep streaming everything else, with no source error, no
restart and no PollerCrashed; the record is named and counted, and leaves when the store clears it.
Before, each such record made every buffer on the store raise PollerCrashed within seconds, for good."""

from __future__ import annotations

from typing import Any

import pytest

from buffer import ReplayBuffer
from poller.sources.transferqueue import SPEC
from poller.wire.vocabulary import UnreadableValue
from tests.conftest import wait_until
from tests.integration.tq_values import CASE_KEY, CASES, GOOD_KEY, INT_PARTITION_CASE
from tests.test_transferqueue_source import EXPECTED_TAGS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _carried(case: str) -> bool:
    """Whether ``case``'s record converts to tags the stream carries (else it is quarantined)."""
    tags = EXPECTED_TAGS[case]
    return (case != INT_PARTITION_CASE and all(isinstance(name, str) for name in tags)
            and not any(isinstance(v, UnreadableValue) for v in tags.values())
            and all(-(2**63) <= v < 2**64 for v in tags.values() if type(v) is int))


def _partition(case: str, prefix: str) -> Any:
    return 1 if case == INT_PARTITION_CASE else f"{prefix}-{case}"


@pytest.mark.parametrize("before_start", [True, False], ids=["stored-before-start", "written-while-running"])
def test_every_kind_of_record_is_carried_or_quarantined_and_the_rest_flows(store, partition, before_start):
    cases = sorted(CASES)
    half = cases[::2] if before_start else []
    for case in half:
        store.call("run", "tests.integration.tq_values:put_case", case=case, partition=_partition(case, partition))
    try:
        with ReplayBuffer(SPEC, source_kwargs=store.call("kwargs"), poll_interval=0.05, max_restarts=0) as rb:
            for case in cases:
                if case not in half:
                    store.call("run", "tests.integration.tq_values:put_case", case=case,
                               partition=_partition(case, partition))
            rb.sync(timeout=60)
            quarantined = {(p, k) for p, k, _ in rb.stats()["quarantined_keys"]}
            for case in cases:
                name = _partition(case, partition)
                held = rb.snapshot(name) if isinstance(name, str) else {}
                if isinstance(name, str):
                    assert GOOD_KEY in held, case  # the record next to it always flows
                if _carried(case):
                    assert CASE_KEY in held, case
                else:
                    assert CASE_KEY not in held, case
                    assert wait_until(lambda name=name: (str(name) if isinstance(name, str) else "1 (int)", CASE_KEY)
                                      in {(p, k) for p, k, _ in rb.stats()["quarantined_keys"]}, timeout=10), \
                        (case, quarantined)
            stats = rb.stats()
            assert stats["restarts"] == 0 and stats["source_errors"] == 0 and stats["poller_alive"]
            assert stats["quarantined"] == sum(not _carried(c) for c in cases) + 1  # the int partition's good key
            for case in cases:
                store.call("run", "tests.integration.tq_values:clear_case", case=case,
                           partition=_partition(case, partition))
            rb.sync(timeout=60)
            assert wait_until(lambda: rb.stats()["quarantined"] == 0, timeout=10), rb.stats()["quarantined_keys"]
            assert rb.stats()["restarts"] == 0
    finally:
        for case in cases:
            store.call("run", "tests.integration.tq_values:clear_case", case=case,
                       partition=_partition(case, partition))


@pytest.mark.parametrize("before_start", [True, False], ids=["stored-before-start", "written-while-running"])
def test_verl_async_samples_every_good_group_beside_quarantined_records(store, before_start):
    out = store.call("run", "tests.integration.record_scenarios:async_with_poison", before_start=before_start,
                     timeout=240)
    assert out["sampled"] == 4 and len(out["quarantined"]) == 3
    assert out["left_after_clear"] == []


def test_an_in_process_source_handing_over_numpy_and_torch_values_is_converted():
    with ReplayBuffer("tests.helpers.sources:NumericTags", poll_interval=0.05, max_restarts=0) as rb:
        batch = rb.sample("train", batch_size=2, timeout=60)
        assert sorted(batch.keys) == ["np", "torch"]
        held = rb.snapshot("train")
        assert held["np"] == {"global_steps": 3, "reward": 0.5, "ok": True, "mask": [0, 1, 2], "status": "success"}
        assert held["torch"] == {"score": 1.0, "ids": [[1, 2], [3, 4]], "status": "success"}
        assert type(held["np"]["global_steps"]) is int and type(held["np"]["ok"]) is bool
        assert wait_until(lambda: rb.stats()["quarantined"] == 1)
        (_, key, why), = rb.stats()["quarantined_keys"]
        assert key == "complex" and "holds a complex, not a number" in why
