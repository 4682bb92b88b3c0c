"""What talks to the store from the trainer for the verl sampler: clears, DAPO metric reads, its batch record.

The poller lists the store in its own process; the few writes and reads the
sampler makes itself run in the trainer:

* on TransferQueue (the default source), through ``transfer_queue``'s
  module functions, in the trainer process that initialised it;
* on any other source (the embedded SQLite store in tests and the example),
  through an instance the trainer builds from the same spec and kwargs; it
  must have ``kv_clear`` (and ``kv_batch_get`` for DAPO).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

from buffer.group_rules import classify
from poller.sources.transferqueue import SPEC as TRANSFERQUEUE_SPEC
from poller.sources.transferqueue import source_kwargs as transferqueue_source_kwargs
from poller.wire.sources import SourceSpec, describe_spec, load_source
from poller.wire.sources import _resolve as resolve_spec

__all__ = ["CONTROLLER_KWARGS", "REWARD_METRIC", "StoreClient", "VerlBatch", "classify_groups",
           "clear_is_all_or_nothing", "clear_keys", "close_client", "controller_kwargs", "is_transferqueue",
           "live_controller", "make_batch", "open_client", "poller_source", "read_metric", "shut_down"]

logger = logging.getLogger(__name__)



class StoreClient(Protocol):
    def kv_clear(self, keys: list[str], partition_id: str) -> None: ...

    def kv_list(self, partition_id: str | None = None) -> Any: ...

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str] | None = None) -> Any: ...


@dataclass
class VerlBatch:
    """A batch shaped like ``transfer_queue.KVBatchMeta``, used when TransferQueue is not loaded."""

    keys: list[str] = field(default_factory=list)
    tags: list[dict[str, Any]] = field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def size(self) -> int:
        return len(self.keys)


def is_transferqueue(source: SourceSpec | None) -> bool:
    return source is None or source == TRANSFERQUEUE_SPEC


def poller_source(source: SourceSpec | None, kwargs: dict[str, Any] | None,
                  partition_id: str | None) -> tuple[SourceSpec, dict[str, Any], bool]:
    """The spec and kwargs the poller lists, and whether the sampler chose the partitions it lists.

    On TransferQueue the poller lists only ``partition_id`` (the partition
    of the first call; ``None``: every partition) unless ``kwargs`` name
    their own ``partition_ids``; the sampler adds each partition it is asked
    about later (:meth:`buffer.ReplayBuffer.include_partitions`).
    TransferQueue's address is looked up here, in the trainer.
    """
    if not is_transferqueue(source):
        assert source is not None
        return source, dict(kwargs or {}), False
    given = dict(kwargs or {})
    chosen = given.get("partition_ids") is None and partition_id is not None
    if chosen:
        given["partition_ids"] = [partition_id]
    if "address" in given:
        return TRANSFERQUEUE_SPEC, given, chosen
    # Options only (call_timeout, ...): the address comes from the live controller.
    return TRANSFERQUEUE_SPEC, transferqueue_source_kwargs(None, **given), chosen


#: The poller's source arguments that name the TransferQueue controller it lists (the rest are options).
CONTROLLER_KWARGS = ("address", "controller_id", "controller_version")


def live_controller(client: Any) -> Any | None:
    """The controller info (a ``ZMQServerInfo``) of the ``transfer_queue`` module's current client; None without one.

    ``client`` is the ``transfer_queue`` module (:func:`open_client`). The
    sampler's own calls, as verl's sampler's, go through the client the last
    ``tq.init()`` made, so its controller is the one to list. Two attribute
    reads, no I/O: cheap enough for every call. TransferQueue (0.1.8-0.1.11)
    keeps the info in the client's ``_controller`` and offers no public
    accessor; a client without it gives None, and the poller then stays on
    the controller it started on. After ``tq.close()`` and before the next
    ``tq.init()`` there is no client (``get_client()`` asserts): None.
    """
    get_client = getattr(client, "get_client", None)
    if not callable(get_client):
        return None
    try:
        current = get_client()
    except AssertionError:  # TransferQueue's words for "not initialised" (after tq.close())
        return None
    return getattr(current, "_controller", None)


def controller_kwargs(info: Any) -> dict[str, Any]:
    """The poller's source arguments naming the controller ``info`` describes (:data:`CONTROLLER_KWARGS`).

    Raises:
        ValueError: ``info`` holds no controller address.
    """
    kwargs = transferqueue_source_kwargs(info)
    return {name: kwargs[name] for name in CONTROLLER_KWARGS}


def open_client(source: SourceSpec | None, kwargs: dict[str, Any] | None, need_fields: bool) -> tuple[Any, bool]:
    """The trainer-side client and whether the sampler owns it (and must close it).

    Raises:
        TypeError: the client lacks ``kv_clear`` (or ``kv_batch_get`` when DAPO needs it).
    """
    if is_transferqueue(source):
        # Imported here, in the trainer that initialised it: import_module keeps type checkers out of it.
        return importlib.import_module("transfer_queue"), False
    assert source is not None
    client = load_source(source, kwargs)
    # load_source hands back a ready-made source object as it is: that one is not ours to close.
    target = resolve_spec(source) if isinstance(source, str) else source
    owned = client is not target
    wanted = ["kv_clear", "kv_list"] + (["kv_batch_get"] if need_fields else [])
    missing = [name for name in wanted if not callable(getattr(client, name, None))]
    if missing:
        if owned:
            _close(client)
        raise TypeError(f"source {describe_spec(source)} built {type(client).__name__}, which has no "
                        f"{' or '.join(missing)}: the sampler clears keys"
                        + (" and reads DAPO metrics" if need_fields else "") + " through it")
    return client, owned


def _close(client: Any) -> None:
    close = getattr(client, "close", None)
    if callable(close):
        close()


def close_client(client: Any, owned: bool) -> None:
    if owned:
        _close(client)


def clear_keys(client: Any, partition_id: str, keys: list[str], verify: bool) -> None:
    """Clear ``keys`` in the store: afterwards none of them is there, whoever cleared one first.

    TransferQueue 0.1.9 made ``kv_clear`` idempotent. On 0.1.8 a clear that
    names a key already gone (the trainer or another reader may have cleared
    one this sampler's view still holds) clears nothing at all, and an empty
    list raises. With ``verify`` (a store that behaves so), and after any
    failed clear, the partition is listed once and the keys still present
    are cleared again; a store that cannot clear what it holds still raises.
    """
    if not keys:
        return
    try:
        client.kv_clear(keys=keys, partition_id=partition_id)
        if not verify:
            return
    except Exception as exc:
        logger.debug("kv_clear of %d keys in %r failed (%s): clearing those still there", len(keys),
                     partition_id, exc)
    held = (client.kv_list(partition_id) or {}).get(partition_id, {})
    present = [key for key in keys if key in held]
    if present:
        client.kv_clear(keys=present, partition_id=partition_id)


def clear_is_all_or_nothing(client: Any, transferqueue: bool) -> bool:
    """Whether a ``kv_clear`` naming a key already gone may clear nothing (TransferQueue 0.1.8)."""
    if transferqueue:
        try:
            return importlib.metadata.version("transferqueue") == "0.1.8"
        except importlib.metadata.PackageNotFoundError:
            return False
    return bool(getattr(client, "clear_is_all_or_nothing", False))


def shut_down(buffer: Any, client: Any, owned: bool) -> None:
    """The sampler's finalizer: close its buffer, then the client it built (no reference to the sampler)."""
    try:
        if buffer is not None:
            buffer.close()
    finally:
        close_client(client, owned)


#: The DAPO metric read from the ``rm_scores`` field (verl 0.9.1's FILTER_GROUPS_REWARD_METRIC).
REWARD_METRIC = "reward"


def read_metric(client: Any, partition_id: str, keys: list[str], metric: str) -> list[float | None]:
    """Each key's DAPO value (None where it is missing).

    ``metric == "reward"``: the key's ``rm_scores`` summed (verl 0.9.1's
    canonical pre-KL reward). ``.sum()`` is called on what the store returns
    (a tensor on TransferQueue), so the trainer side imports no torch for
    it; a plain list of numbers (the SQLite store's JSON) is summed as is.
    Any other name: ``extra_fields["reward_extra_info"][metric]``.
    """
    if not keys:
        return []
    field_name = "rm_scores" if metric == REWARD_METRIC else "extra_fields"
    data = client.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=[field_name])
    column = list(data[field_name])
    if len(column) != len(keys):
        raise RuntimeError(f"kv_batch_get returned {len(column)} {field_name} for {len(keys)} keys")
    if field_name == "rm_scores":
        return [_summed(scores) for scores in column]
    values: list[float | None] = []
    for extra in column:
        extra = getattr(extra, "data", extra)  # TransferQueue wraps non-tensor values
        info = extra.get("reward_extra_info", {}) if isinstance(extra, dict) else {}
        values.append(float(info[metric]) if isinstance(info, dict) and metric in info else None)
    return values


def _summed(scores: Any) -> float | None:
    """One trajectory's ``rm_scores`` summed: a tensor or array's own ``.sum()``, or a list's ``sum``."""
    if scores is None:
        return None
    total = scores.sum() if callable(getattr(scores, "sum", None)) else sum(scores)
    # float() of a 0-d tensor or numpy scalar is its value (.item()).
    return float(total)


def classify_groups(client: Any, partition_id: str, groups: dict[str, list[str]],
                    metric: str) -> dict[str, tuple[list[str], float | None]]:
    """uid -> (the trajectory keys read, the value DAPO filters on or None), for finished groups.

    Raises:
        RuntimeError: a group has no trajectory, or one without the metric (verl's error).
    """
    keys = [key for group_keys in groups.values() for key in group_keys]
    values = iter(read_metric(client, partition_id, keys, metric))
    classes: dict[str, tuple[list[str], float | None]] = {}
    missing = []
    for uid, group_keys in groups.items():
        group_values = [next(values) for _ in group_keys]
        present = [value for value in group_values if value is not None]
        if not group_values or len(present) != len(group_values):
            missing.append(uid)
        else:
            classes[uid] = (group_keys, classify(present))
    if missing:
        raise RuntimeError(f"Finished groups are missing DAPO metric {metric!r}: {sorted(missing)[:5]}")
    return classes


def make_batch(partition_id: str, keys: list[str], tags: list[dict[str, Any]], transferqueue: bool) -> Any:
    """``transfer_queue.KVBatchMeta`` on TransferQueue or when it is loaded anyway, else a :class:`VerlBatch`."""
    if transferqueue or "transfer_queue" in sys.modules:
        meta = importlib.import_module("transfer_queue").KVBatchMeta
        return meta(partition_id=partition_id, keys=keys, tags=tags)
    return VerlBatch(keys=keys, tags=tags, partition_id=partition_id)
