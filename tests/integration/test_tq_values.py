"""Tag values as rollout workers write them (numpy and torch scalars, arrays, tensors, big ints,
tuples, int tag names and partition ids), through a real TransferQueue: the source lists every key,
with each value converted or an UnreadableValue in its place, and the poller imports neither numpy
nor torch. The same cases, recorded once, run without TransferQueue in tests/test_transferqueue_source.py."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from buffer import ReplayBuffer
from poller.sources.transferqueue import SPEC, TransferQueueSource
from poller.wire.vocabulary import UnreadableValue
from tests.conftest import wait_until
from tests.integration.tq_values import CASE_KEY, CASES, GOOD_KEY, GOOD_TAGS, INT_PARTITION_CASE
from tests.test_transferqueue_source import EXPECTED_TAGS, typed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent.parent


def _partition_of(case: str, partition: str) -> Any:
    return 1 if case == INT_PARTITION_CASE else partition


def _expected(case: str, pickled_whole: bool = False) -> dict:
    tags = EXPECTED_TAGS[case]
    if pickled_whole and case == "aware_datetime":  # pickled, the datetime class is what is refused
        tags = {"when": UnreadableValue("a pickled datetime.datetime object, which this source does not unpickle")}
    return {CASE_KEY: tags, GOOD_KEY: GOOD_TAGS}


def _put(store: Any, case: str, partition: str, batch: bool = False) -> None:
    store.call("run", "tests.integration.tq_values:put_case", case=case, partition=partition, batch=batch)


def test_the_cases_are_the_recorded_ones():
    assert set(CASES) == set(EXPECTED_TAGS)


@pytest.mark.parametrize("batch", [False, True], ids=["kv_put", "kv_batch_put"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_source_lists_every_key_with_each_value_converted_or_unreadable(store, partition, case, batch):
    _put(store, case, partition, batch=batch)
    source = TransferQueueSource(**store.call("kwargs"))  # the source imports no TransferQueue, Ray or torch
    try:
        listing = source.kv_list()
    finally:
        source.close()
        store.call("run", "tests.integration.tq_values:clear_case", case=case, partition=partition)
    assert typed(listing[_partition_of(case, partition)]) == typed(_expected(case))


def test_in_a_separate_process_every_case_lists_without_numpy_or_torch(store, partition):
    for case in CASES:
        _put(store, case, f"{partition}-{case}")
    code = ("import json, pickle, sys; from poller.sources.transferqueue import TransferQueueSource; "
            "s = TransferQueueSource(**json.loads(sys.argv[1])); listing = s.kv_list(); s.close(); "
            "sys.stdout.buffer.write(pickle.dumps((listing, sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('numpy', 'torch', 'transfer_queue', 'ray')))))")
    try:
        result = subprocess.run([sys.executable, "-c", code, json.dumps(store.call("kwargs"))], cwd=ROOT,
                                capture_output=True, timeout=120)
    finally:
        for case in CASES:
            store.call("run", "tests.integration.tq_values:clear_case", case=case, partition=f"{partition}-{case}")
    assert result.returncode == 0, result.stderr.decode()
    listing, heavy = pickle.loads(result.stdout)  # our own child's result: plain values and UnreadableValue
    assert heavy == []
    for case in CASES:  # the big ints make the controller pickle this whole reply
        assert typed(listing[_partition_of(case, f"{partition}-{case}")]) == typed(
            _expected(case, pickled_whole=True)), case


def _plain_case(case: str) -> bool:
    """Whether every tag of ``case`` converts to a value the buffer's own wire carries as it is."""
    tags = EXPECTED_TAGS[case]
    return (case != INT_PARTITION_CASE and all(isinstance(k, str) for k in tags)
            and not any(isinstance(v, UnreadableValue) for v in tags.values())
            and all(abs(v) < 2**63 for v in tags.values() if type(v) is int))


CONVERTED = sorted(case for case in CASES if _plain_case(case))


def test_a_buffer_receives_converted_numpy_and_torch_values_and_its_poller_loads_neither(store, partition):
    assert {"np_int64", "np_float32", "np_arange", "np_array", "torch_scalar", "torch_tensor", "tuple"} <= set(
        CONVERTED)
    # Only these partitions: an int partition id left by another test is the poller's to refuse.
    kwargs = store.call("kwargs", partition_ids=[f"{partition}-{case}" for case in CONVERTED])
    with ReplayBuffer(SPEC, source_kwargs=kwargs, poll_interval=0.05) as rb:
        for case in CONVERTED:
            _put(store, case, f"{partition}-{case}", batch=True)
        try:
            for case in CONVERTED:
                name = f"{partition}-{case}"
                # kv_batch_put lists the keys before their tags: a listing in between sees {} for
                # both, so wait for the tags themselves, then show what arrived if they never did.
                expected = typed(_expected(case))
                wait_until(lambda name=name, expected=expected: typed(rb.snapshot(name)) == expected, timeout=60)
                assert typed(rb.snapshot(name)) == expected, case
            stats = rb.stats()
            maps = Path(f"/proc/{stats['poller_pid']}/maps").read_text()
        finally:
            for case in CONVERTED:
                store.call("run", "tests.integration.tq_values:clear_case", case=case,
                           partition=f"{partition}-{case}")
    assert stats["restarts"] == 0 and stats["source_errors"] == 0
    assert "numpy" not in maps and "torch" not in maps
