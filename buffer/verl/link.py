"""The verl sampler's link to its store: the buffer whose poller lists it, and the client of its own calls.

Constructing the sampler does no I/O, so a trainer whose constructor fails
after building it leaks nothing: both start on the first call, and a
finalizer shuts both down when the sampler is dropped (verl never calls
``close()``). The client is ``transfer_queue``'s module on TransferQueue (the
default source), elsewhere a source built from the same spec and kwargs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
import weakref
from functools import partial
from typing import Any, cast

from buffer.errors import BufferClosed
from buffer.process import ShutdownReport
from buffer.replay import ReplayBuffer
from buffer.verl.config import SamplerConfig
from buffer.verl.groups import GroupIndex, classify
from poller.sources.contract import SourceSpec, describe_spec, load_source, resolve_spec

__all__ = ["QUIET_POLL_INTERVAL", "TRANSFERQUEUE", "StoreLink"]

logger = logging.getLogger(__name__)

#: The poller's TransferQueue source, and its arguments looked up in the trainer's live TransferQueue
#: (``source_kwargs(conf, **options)``), named by spec: the trainer imports no poller module but the wire.
TRANSFERQUEUE = "poller.sources.transferqueue:TransferQueueSource"
_TRANSFERQUEUE_KWARGS = "poller.sources.transferqueue:source_kwargs"
#: The poller's source arguments that name the TransferQueue controller it lists (the rest are options).
CONTROLLER_KWARGS = ("address", "controller_id", "controller_version")

#: The poller's own schedule: none to speak of. As verl's own sampler, the calls list the store (a SYNC at the start
#: of each, and while one waits), and nothing lists it while the trainer trains.
QUIET_POLL_INTERVAL = 3600.0

#: The DAPO metric read from the ``rm_scores`` field (verl 0.9.1's FILTER_GROUPS_REWARD_METRIC).
REWARD_METRIC = "reward"


class _GroupBuffer(ReplayBuffer):
    """The sampler's buffer: it samples by group (its own index), so it keeps no step index for ``sample()``."""

    _step_index_at_start = False


class StoreLink:
    """A verl sampler's buffer (``index`` attached) and the client of its own clears and reads (module docstring)."""

    def __init__(self, config: SamplerConfig, index: GroupIndex) -> None:
        self._config = config
        self._index = index
        self._lock = threading.Lock()
        self.on_transferqueue = _is_transferqueue(config.source)  # its answers are TransferQueue's KVBatchMeta
        self.buffer: ReplayBuffer | None = None
        self.started_now = False
        self.closed = False
        self._finalizer: weakref.finalize | None = None
        self._client: Any = None
        # Whether a kv_clear naming a key already gone may clear nothing (see clear()).
        self._verify_clears = False
        # The partitions the poller lists, when the sampler chose them (None: the source's own choice, or all).
        self._listed: set[str] | None = None
        # On TransferQueue: the controller listed (its address and its id: a new controller may reuse a port), and
        # the client's controller info last compared with it.
        self._controller: tuple[Any, Any] | None = None
        self._compared: Any = None

    def start(self, partition_id: str | None = None) -> ReplayBuffer:
        """The buffer and client, started on first use; the poller lists ``partition_id`` (None: every partition).
        :attr:`started_now` says whether this call started them."""
        with self._lock:
            if self.closed:
                raise BufferClosed("the sampler is closed")
            self.started_now = self.buffer is None
            if self.buffer is not None:
                return self.buffer
            config = self._config
            spec, kwargs, chosen = _poller_source(config.source, config.source_kwargs, partition_id)
            self._listed = {partition_id} if chosen and partition_id is not None else None
            self._controller = ((kwargs.get("address"), kwargs.get("controller_id")) if self.on_transferqueue
                                else None)
            client, owned = _open_client(config.source, config.source_kwargs, config.filter_groups_metric is not None)
            try:
                # Listings only when a call asks: at once (the calls keep verl's own sampler's schedule).
                buffer = _GroupBuffer(spec, source_kwargs=kwargs, poll_interval=QUIET_POLL_INTERVAL,
                                      listing_share=1.0, **config.buffer_kwargs)
            except BaseException:
                _close_client(client, owned)
                raise
            # Tied to this object, which only the sampler holds: dropping the sampler runs it.
            self._finalizer = weakref.finalize(self, _shut_down, buffer, client, owned)
            try:
                buffer.sampling.attach(self._index)
            except BaseException:
                self._finalizer()
                raise
            self._client = client
            self._verify_clears = _tq_version() == "0.1.8" if self.on_transferqueue else \
                bool(getattr(client, "clear_is_all_or_nothing", False))
            self.buffer = buffer
            logger.debug("verl sampler started: %r", buffer)
            return buffer

    def running(self) -> ReplayBuffer | None:
        """The buffer started (``None``: nothing yet), without starting it."""
        with self._lock:
            if self.closed:
                raise BufferClosed("the sampler is closed")
            return self.buffer

    def follow(self) -> bool:
        """On TransferQueue: move the poller to the controller the trainer's client uses now; True when it moved.

        verl's own sampler lists through that client, so it follows ``tq.close()`` and ``tq.init()`` (a new
        controller, a new port); so does this, by :meth:`buffer.ReplayBuffer.switch_source`.
        """
        buffer = self.buffer
        if buffer is None or not self.on_transferqueue:
            return False
        get_client = getattr(self._client, "get_client", None)
        try:  # TransferQueue 0.1.8-0.1.11 keep the client's controller info in the private _controller
            info = getattr(get_client(), "_controller", None) if callable(get_client) else None
        except AssertionError:  # TransferQueue's words for "not initialised" (between tq.close() and tq.init())
            return False
        with self._lock:
            if info is None or info is self._compared:
                return False
            self._compared = info
            kwargs = resolve_spec(_TRANSFERQUEUE_KWARGS)(info)
            changes = {name: kwargs[name] for name in CONTROLLER_KWARGS}
            controller = (changes["address"], changes["controller_id"])
            if controller == self._controller:
                return False
            old, self._controller = self._controller, controller
        logger.info("the trainer's TransferQueue client uses controller %s at %s: the poller moves there from %s",
                    changes["controller_id"], changes["address"], old and f"{old[1]} at {old[0]}")
        buffer.switch_source(changes)
        return True

    def include(self, partition_id: str) -> bool:
        """Have the poller list ``partition_id`` too (verl names partitions only in its calls); True if it joined."""
        if self._listed is None or partition_id in self._listed:
            return False
        assert self.buffer is not None  # _listed is set as the buffer starts
        self.buffer.include_partitions([partition_id])
        self._listed.add(partition_id)
        return True

    def clear(self, partition_id: str, keys: list[str]) -> None:
        """Clear ``keys`` in the store: afterwards none of them is there, whoever cleared one first.

        On TransferQueue 0.1.8 a clear naming a key already gone clears nothing
        at all. So with ``_verify_clears``, and after any failed clear, the keys
        still listed are cleared again; a store that cannot clear them raises.
        """
        if not keys:
            return
        try:
            self._client.kv_clear(keys=keys, partition_id=partition_id)
            if not self._verify_clears:
                return
        except Exception as exc:
            logger.debug("kv_clear of %d keys in %r failed (%s): clearing those still there", len(keys),
                         partition_id, exc)
        held = (self._client.kv_list(partition_id) or {}).get(partition_id, {})
        present = [key for key in keys if key in held]
        if present:
            self._client.kv_clear(keys=present, partition_id=partition_id)

    def classify(self, partition_id: str, groups: dict[str, list[str]],
                 metric: str) -> dict[str, tuple[list[str], float | None]]:
        """uid -> (the trajectory keys read, the value DAPO filters on or None), for finished groups.

        ``"reward"`` is each key's ``rm_scores`` summed (verl 0.9.1's pre-KL reward) by its own ``.sum()``
        (no torch import here); any other metric is ``extra_fields["reward_extra_info"][metric]``.

        Raises:
            RuntimeError: a group has no trajectory, or one without the metric (verl's error).
        """
        keys = [key for group_keys in groups.values() for key in group_keys]
        field_name = "rm_scores" if metric == REWARD_METRIC else "extra_fields"
        column = list(self._client.kv_batch_get(keys=keys, partition_id=partition_id,
                                                select_fields=[field_name])[field_name]) if keys else []
        if len(column) != len(keys):
            raise RuntimeError(f"kv_batch_get returned {len(column)} {field_name} for {len(keys)} keys")
        read = _summed if field_name == "rm_scores" else partial(_extra_metric, metric=metric)
        values = iter([read(value) for value in column])
        classes: dict[str, tuple[list[str], float | None]] = {}
        missing = []
        for uid, group_keys in groups.items():
            group_values = [next(values) for _ in group_keys]
            if not group_values or None in group_values:
                missing.append(uid)
            else:
                classes[uid] = (group_keys, classify(cast("list[float]", group_values)))
        if missing:
            raise RuntimeError(f"Finished groups are missing DAPO metric {metric!r}: {sorted(missing)[:5]}")
        return classes

    def close(self, timeout: float | None = None) -> ShutdownReport:
        """Stop the poller and close the client; idempotent. Nothing started: a ``no-poller`` report."""
        with self._lock:
            self.closed = True
            buffer, finalizer = self.buffer, self._finalizer
        if buffer is None:
            return ShutdownReport("no-poller", 0.0, None, False)
        report = buffer.close(timeout)
        if finalizer is not None:
            finalizer()
        return report


def _shut_down(buffer: ReplayBuffer, client: Any, owned: bool) -> None:
    try:
        buffer.close()
    finally:
        _close_client(client, owned)


def _is_transferqueue(source: SourceSpec | None) -> bool:
    return source is None or source == TRANSFERQUEUE


def _poller_source(source: SourceSpec | None, kwargs: dict[str, Any] | None,
                   partition_id: str | None) -> tuple[SourceSpec, dict[str, Any], bool]:
    """The spec and kwargs the poller lists, and whether the sampler chose the partitions it lists.

    On TransferQueue: only ``partition_id`` unless ``kwargs`` name their own
    ``partition_ids``; without an ``address``, the live controller's.
    """
    given = dict(kwargs or {})
    if source is not None and not _is_transferqueue(source):
        return source, given, False
    chosen = given.get("partition_ids") is None and partition_id is not None
    if chosen:
        given["partition_ids"] = [partition_id]
    return TRANSFERQUEUE, given if "address" in given else resolve_spec(_TRANSFERQUEUE_KWARGS)(None, **given), chosen


def _open_client(source: SourceSpec | None, kwargs: dict[str, Any] | None, need_fields: bool) -> tuple[Any, bool]:
    """The trainer-side client, and whether it was built here (and must be closed here)."""
    if source is None or _is_transferqueue(source):
        # Imported here, in the trainer that initialised it: import_module keeps type checkers out of it.
        return importlib.import_module("transfer_queue"), False
    client = load_source(source, kwargs)
    # load_source hands back a ready-made source object as it is: that one is not ours to close.
    owned = client is not (resolve_spec(source) if isinstance(source, str) else source)
    wanted = ["kv_clear", "kv_list"] + (["kv_batch_get"] if need_fields else [])
    missing = [name for name in wanted if not callable(getattr(client, name, None))]
    if missing:
        _close_client(client, owned)
        raise TypeError(f"source {describe_spec(source)} built {type(client).__name__}, which has no "
                        f"{' or '.join(missing)}: the sampler clears keys"
                        + (" and reads DAPO metrics" if need_fields else "") + " through it")
    return client, owned


def _close_client(client: Any, owned: bool) -> None:
    close = getattr(client, "close", None)
    if owned and callable(close):
        close()


def _summed(scores: Any) -> float | None:
    if scores is None:
        return None
    total = scores.sum() if callable(getattr(scores, "sum", None)) else sum(scores)
    return float(total)  # float() of a 0-d tensor or numpy scalar is its value (.item())


def _extra_metric(extra: Any, metric: str) -> float | None:
    extra = getattr(extra, "data", extra)  # TransferQueue wraps non-tensor values
    info = extra.get("reward_extra_info", {}) if isinstance(extra, dict) else {}
    return float(info[metric]) if isinstance(info, dict) and metric in info else None


def _tq_version() -> str | None:
    try:
        return importlib.metadata.version("transferqueue")
    except importlib.metadata.PackageNotFoundError:
        return None
