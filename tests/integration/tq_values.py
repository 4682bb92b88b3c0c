"""Tag values as rollout workers write them, put into a real TransferQueue by the store host.

Each case is one record written with ``tq.kv_put`` (or ``kv_batch_put``)
next to a plain record (``GOOD_KEY``) in the same partition. The builders
import numpy and torch, so they run in the store host (``StoreHost.call("run",
"tests.integration.tq_values:put_case", ...)``), never in the test process.
Used by the integration tests and by ``capture_tq_replies.py``, which records
the controller's raw KV_LIST replies for the unit tests.
"""

from __future__ import annotations

import collections
import datetime
from typing import Any, Callable

GOOD_KEY = "good"
GOOD_TAGS = {"global_steps": 1, "status": "success"}
CASE_KEY = "case"


def _np() -> Any:
    import numpy

    return numpy


def _torch() -> Any:
    import torch

    return torch


#: case name -> the tags of ``CASE_KEY`` (built in the host, where numpy and torch are).
CASES: dict[str, Callable[[], dict[Any, Any]]] = {
    "np_int64": lambda: {"global_steps": _np().int64(3), "status": "success"},
    "np_float32": lambda: {"reward": _np().float32(0.5), "status": "success"},
    "np_float64": lambda: {"reward": _np().float64(0.25)},
    "np_bool": lambda: {"ok": _np().bool_(True), "bad": _np().bool_(False)},
    "np_uint8": lambda: {"small": _np().uint8(255), "neg": _np().int8(-3)},
    "np_arange": lambda: {"global_steps": _np().arange(5)[3], "steps": list(_np().arange(3)),
                          "half": _np().arange(0, 1, 0.5)[1]},
    "np_array": lambda: {"mask": _np().arange(4), "grid": _np().ones((2, 2), dtype=_np().float32),
                         "flags": _np().array([True, False])},
    "np_str_array": lambda: {"names": _np().array(["a", "bc"])},
    "np_object_array": lambda: {"objs": _np().array(["a", 1], dtype=object)},
    "np_datetime": lambda: {"when": _np().datetime64("2026-01-02")},
    "np_complex": lambda: {"z": _np().complex64(1 + 2j)},
    "torch_scalar": lambda: {"reward": _torch().tensor(1.0), "global_steps": _torch().tensor(3),
                             "ok": _torch().tensor(True)},
    "torch_half": lambda: {"bf16": _torch().tensor(2.5, dtype=_torch().bfloat16),
                           "f16": _torch().tensor(0.5, dtype=_torch().float16)},
    "torch_tensor": lambda: {"ids": _torch().tensor([1, 2, 3]), "grid": _torch().arange(4).reshape(2, 2)},
    "torch_complex": lambda: {"z": _torch().tensor(1 + 2j)},
    "big_int": lambda: {"big": 2**70, "status": "success"},
    "big_int_with_numpy": lambda: {"big": -(2**64), "global_steps": _np().int64(4), "reward": _torch().tensor(1.0),
                                   "span": (1, 2)},
    "big_int_with_arrays": lambda: {
        "big": 2**70, "mask": _np().arange(3), "grid": _np().arange(6, dtype=_np().float32).reshape(2, 3).T,
        "column": _torch().arange(6).reshape(2, 3)[:, 1], "bf16": _torch().tensor([1.5, -2.0], dtype=_torch().bfloat16),
        "flags": _torch().tensor([True, False]), "objs": _np().array(["a", 1], dtype=object)},
    "tuple": lambda: {"span": (1, 2), "nested": [(3, (4, "x"))]},
    "set": lambda: {"ids": {5}},
    "ordered_dict": lambda: {"meta": collections.OrderedDict(a=1, b=[2])},
    "aware_datetime": lambda: {"when": datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc)},
    "int_tag_name": lambda: {7: "x", "status": "success"},
}

#: Cases written to ``partition_id=1`` (an int) instead of the test's partition name.
INT_PARTITION_CASE = "int_partition"
CASES[INT_PARTITION_CASE] = lambda: {"global_steps": 2, "status": "success"}


def put_case(conf: Any, case: str, partition: str, batch: bool = False) -> None:
    """Write ``case``'s record and the good record, as a rollout worker would (runs in the store host)."""
    import transfer_queue as tq

    del conf  # TransferQueue is live in this process; the module-level API finds it
    partition_id: Any = 1 if case == INT_PARTITION_CASE else partition
    tags = CASES[case]()
    if batch:
        tq.kv_batch_put([CASE_KEY, GOOD_KEY], partition_id, tags=[tags, dict(GOOD_TAGS)])
    else:
        tq.kv_put(CASE_KEY, partition_id, tag=tags)
        tq.kv_put(GOOD_KEY, partition_id, tag=dict(GOOD_TAGS))


def clear_case(conf: Any, case: str, partition: str) -> None:
    """Remove what :func:`put_case` wrote, partition and all (runs in the store host).

    ``kv_clear`` would leave the partition listed, empty: an int partition id
    left behind would then reach every later test's poller.
    """
    import transfer_queue as tq

    del conf
    tq.get_client().clear_partition(1 if case == INT_PARTITION_CASE else partition)
