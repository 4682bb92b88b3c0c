"""The verl sampler's own calls to the store, made in the trainer: clears, DAPO metric reads, its batch.

The poller lists the store in its own process; the few writes and reads the
sampler makes itself run here: on TransferQueue (the default source) through
``transfer_queue``'s module functions, in the trainer process that
initialised it; on any other source (the SQLite store in tests and the
example) through an instance built from the same spec and kwargs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from buffer.verl.rules import classify
from poller.wire.sources import SourceSpec, describe_spec, load_source
from poller.wire.sources import _resolve as resolve_spec

__all__ = ["TRANSFERQUEUE", "StoreCalls", "VerlBatch", "is_transferqueue", "transferqueue_kwargs"]

logger = logging.getLogger(__name__)

#: The poller's TransferQueue source, named by spec: the trainer imports no poller module but the wire.
TRANSFERQUEUE = "poller.sources.transferqueue:TransferQueueSource"
#: Its source arguments from the trainer's live TransferQueue (the public ``source_kwargs(conf, **options)``).
_TRANSFERQUEUE_KWARGS = "poller.sources.transferqueue:source_kwargs"

#: The DAPO metric read from the ``rm_scores`` field (verl 0.9.1's FILTER_GROUPS_REWARD_METRIC).
REWARD_METRIC = "reward"


def is_transferqueue(source: SourceSpec | None) -> bool:
    return source is None or source == TRANSFERQUEUE


def transferqueue_kwargs(conf: Any, **options: Any) -> dict[str, Any]:
    """The poller's TransferQueue source arguments, the controller's address looked up here, in the trainer.

    Raises:
        ValueError: ``conf`` holds no controller address.
    """
    kwargs: dict[str, Any] = resolve_spec(_TRANSFERQUEUE_KWARGS)(conf, **options)
    return kwargs


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


class StoreCalls:
    """The trainer-side client of the sampler's clears and reads; :meth:`close` closes it if it built it.

    Raises:
        TypeError: the client lacks ``kv_clear`` or ``kv_list`` (or ``kv_batch_get`` when DAPO needs it).
    """

    def __init__(self, source: SourceSpec | None, kwargs: dict[str, Any] | None, need_fields: bool) -> None:
        self.transferqueue = is_transferqueue(source)
        self.owned = False
        if source is None or self.transferqueue:
            # Imported here, in the trainer that initialised it: import_module keeps type checkers out of it.
            self.client: Any = importlib.import_module("transfer_queue")
        else:
            self.client = load_source(source, kwargs)
            # load_source hands back a ready-made source object as it is: that one is not ours to close.
            self.owned = self.client is not (resolve_spec(source) if isinstance(source, str) else source)
            wanted = ["kv_clear", "kv_list"] + (["kv_batch_get"] if need_fields else [])
            missing = [name for name in wanted if not callable(getattr(self.client, name, None))]
            if missing:
                self.close()
                raise TypeError(f"source {describe_spec(source)} built {type(self.client).__name__}, which has no "
                                f"{' or '.join(missing)}: the sampler clears keys"
                                + (" and reads DAPO metrics" if need_fields else "") + " through it")
        # Whether a kv_clear naming a key already gone may clear nothing (TransferQueue 0.1.8): then every
        # clear is checked by listing.
        self.verify_clears = _tq_version() == "0.1.8" if self.transferqueue else \
            bool(getattr(self.client, "clear_is_all_or_nothing", False))

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if self.owned and callable(close):
            close()

    def controller(self) -> Any | None:
        """The controller info (a ``ZMQServerInfo``) of the ``transfer_queue`` module's current client, or None.

        The client the last ``tq.init()`` made: the sampler's own calls go
        through it, so its controller is the one to list. TransferQueue
        (0.1.8-0.1.11) keeps the info in the private ``_controller``; None
        without it, and between ``tq.close()`` and the next ``tq.init()``.
        """
        get_client = getattr(self.client, "get_client", None)
        if not callable(get_client):
            return None
        try:
            current = get_client()
        except AssertionError:  # TransferQueue's words for "not initialised" (after tq.close())
            return None
        return getattr(current, "_controller", None)

    def clear(self, partition_id: str, keys: list[str]) -> None:
        """Clear ``keys`` in the store: afterwards none of them is there, whoever cleared one first.

        On TransferQueue 0.1.8 (0.1.9 made it idempotent) a clear naming a key
        already gone clears nothing at all. So with ``verify_clears``, and after
        any failed clear, the partition is listed once and the keys still
        present are cleared again; a store that cannot clear them still raises.
        """
        if not keys:
            return
        try:
            self.client.kv_clear(keys=keys, partition_id=partition_id)
            if not self.verify_clears:
                return
        except Exception as exc:
            logger.debug("kv_clear of %d keys in %r failed (%s): clearing those still there", len(keys),
                         partition_id, exc)
        held = (self.client.kv_list(partition_id) or {}).get(partition_id, {})
        present = [key for key in keys if key in held]
        if present:
            self.client.kv_clear(keys=present, partition_id=partition_id)

    def classify(self, partition_id: str, groups: dict[str, list[str]],
                 metric: str) -> dict[str, tuple[list[str], float | None]]:
        """uid -> (the trajectory keys read, the value DAPO filters on or None), for finished groups.

        Raises:
            RuntimeError: a group has no trajectory, or one without the metric (verl's error).
        """
        keys = [key for group_keys in groups.values() for key in group_keys]
        values = iter(self._read_metric(partition_id, keys, metric))
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

    def _read_metric(self, partition_id: str, keys: list[str], metric: str) -> list[float | None]:
        """Each key's DAPO value (None where it is missing).

        ``"reward"``: the key's ``rm_scores`` summed (verl 0.9.1's pre-KL
        reward) by its own ``.sum()`` (a tensor: no torch import here) or as a
        list. Any other name: ``extra_fields["reward_extra_info"][metric]``.
        """
        if not keys:
            return []
        field_name = "rm_scores" if metric == REWARD_METRIC else "extra_fields"
        data = self.client.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=[field_name])
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

    def batch(self, partition_id: str, keys: list[str], tags: list[dict[str, Any]]) -> Any:
        """``transfer_queue.KVBatchMeta`` on TransferQueue or when it is loaded anyway, else a :class:`VerlBatch`."""
        if self.transferqueue or "transfer_queue" in sys.modules:
            meta = importlib.import_module("transfer_queue").KVBatchMeta
            return meta(partition_id=partition_id, keys=keys, tags=tags)
        return VerlBatch(keys=keys, tags=tags, partition_id=partition_id)


def _summed(scores: Any) -> float | None:
    if scores is None:
        return None
    total = scores.sum() if callable(getattr(scores, "sum", None)) else sum(scores)
    return float(total)  # float() of a 0-d tensor or numpy scalar is its value (.item())


def _tq_version() -> str | None:
    try:
        return importlib.metadata.version("transferqueue")
    except importlib.metadata.PackageNotFoundError:
        return None
