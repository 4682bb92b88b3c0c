"""The verl sampler's buffer and store client: started on its first call, shut down together.

Constructing the sampler does no I/O, so a trainer whose constructor fails
after building it leaks nothing; verl never calls ``close()``, so a finalizer
shuts both down when the sampler is dropped, or at the interpreter's exit.

On TransferQueue the poller lists, as verl's own sampler does, only when a
call needs it (:data:`QUIET_POLL_INTERVAL`), only the partitions the sampler
is asked about (:meth:`SamplerLifecycle.include`), and the controller the
trainer's TransferQueue client uses now (:meth:`SamplerLifecycle.follow`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from buffer.errors import BufferClosed
from buffer.process import ShutdownReport
from buffer.replay import ReplayBuffer
from buffer.seam import SamplingSeam
from buffer.verl.config import SamplerConfig
from buffer.verl.groups import GroupIndex
from buffer.verl.store import TRANSFERQUEUE, StoreCalls, is_transferqueue, transferqueue_kwargs
from poller.wire.sources import SourceSpec

__all__ = ["QUIET_POLL_INTERVAL", "SamplerLifecycle", "Started"]

logger = logging.getLogger(__name__)

#: The poller's own schedule when it does not list between calls: the calls ask for every listing
#: they need (a SYNC), and the store is not listed while the trainer trains.
QUIET_POLL_INTERVAL = 3600.0

#: The poller's source arguments that name the TransferQueue controller it lists (the rest are options).
CONTROLLER_KWARGS = ("address", "controller_id", "controller_version")


@dataclass
class Started:
    """A started sampler: its buffer, the buffer's seam, and the client of its own clears and reads."""

    buffer: ReplayBuffer
    seam: SamplingSeam
    store: StoreCalls


class SamplerLifecycle:
    """Starts a verl sampler's buffer and client on first use, and shuts both down once.

    ``index`` is attached to the buffer's store as it starts. Thread-safe.
    """

    def __init__(self, config: SamplerConfig, index: GroupIndex) -> None:
        self._config = config
        self._index = index
        self._lock = threading.Lock()
        # A store without a change feed (TransferQueue) is listed whole each time, and its controller is
        # shared by every rollout worker: verl's own sampler lists it only inside its calls.
        self._follows = is_transferqueue(config.source)
        self.lists_between_calls = (config.list_between_calls if config.list_between_calls is not None
                                    else not self._follows)
        self.started: Started | None = None
        self.closed = False
        self._finalizer: weakref.finalize | None = None
        # The partitions the poller lists, when the sampler chose them (None: the source's own choice, or all).
        self._listed: set[str] | None = None
        # On TransferQueue: the controller address the poller lists, and the client's controller info last
        # compared with it (the same object again needs no comparison).
        self._address: str | None = None
        self._compared: Any = None

    def start(self, partition_id: str | None = None) -> Started:
        """The buffer and client, started on first use; the poller lists ``partition_id`` (None: every partition).

        Raises:
            BufferClosed: the sampler was closed.
        """
        with self._lock:
            if self.closed:
                raise BufferClosed("the sampler is closed")
            if self.started is not None:
                return self.started
            config = self._config
            spec, kwargs, chosen = _poller_source(config.source, config.source_kwargs, partition_id)
            self._listed = {partition_id} if chosen and partition_id is not None else None
            self._address = kwargs.get("address") if self._follows else None
            store = StoreCalls(config.source, config.source_kwargs, need_fields=config.filter_groups_metric is not None)
            try:
                interval = config.poll_interval if self.lists_between_calls else QUIET_POLL_INTERVAL
                buffer = ReplayBuffer(spec, source_kwargs=kwargs, poll_interval=interval, **config.buffer_kwargs)
            except BaseException:
                store.close()
                raise
            # Tied to this object, which only the sampler holds (its arguments hold neither): dropping
            # the sampler runs it.
            self._finalizer = weakref.finalize(self, _shut_down, buffer, store)
            try:
                buffer.seam.attach(self._index)
            except BaseException:
                self._finalizer()
                raise
            self.started = Started(buffer, buffer.seam, store)
            logger.debug("verl sampler started: %r", buffer)
            return self.started

    def running(self) -> Started | None:
        """What was started (``None``: nothing yet), without starting it.

        Raises:
            BufferClosed: the sampler was closed.
        """
        with self._lock:
            if self.closed:
                raise BufferClosed("the sampler is closed")
            return self.started

    def follow(self) -> bool:
        """On TransferQueue: move the poller to the controller the trainer's TransferQueue client uses now.

        As verl's own sampler, which lists through that client on every call,
        follows ``tq.close()`` and ``tq.init()`` (a new controller on a new
        port). Two attribute reads while nothing changed; without a client the
        poller keeps its controller. A move is
        :meth:`buffer.ReplayBuffer.switch_source` (no crash, no restart budget):
        no decision is made until the new controller's first complete listing
        drops every key of the old one. True when it moved.

        Raises:
            BufferClosed, PollerCrashed: from the switch.
        """
        started = self.started
        if started is None or not self._follows:
            return False
        info = started.store.controller()
        with self._lock:
            if info is None or info is self._compared:
                return False
            self._compared = info
            kwargs = transferqueue_kwargs(info)
            changes = {name: kwargs[name] for name in CONTROLLER_KWARGS}
            if changes["address"] == self._address:
                return False
            old, self._address = self._address, changes["address"]
        logger.info("the trainer's TransferQueue client uses the controller at %s: the poller moves there from %s",
                    changes["address"], old)
        started.buffer.switch_source(changes)
        return True

    def include(self, partition_id: str) -> bool:
        """Have the poller list ``partition_id`` too, when the sampler chose the partitions it lists.

        verl 0.9.1 names its partitions only in its calls (``"train"``, and
        ``"val"`` while it validates). True when it joined: the next decision
        must wait for a listing that includes it.
        """
        if self._listed is None or partition_id in self._listed:
            return False
        assert self.started is not None  # _listed is set as the buffer starts
        self.started.buffer.include_partitions([partition_id])
        self._listed.add(partition_id)
        return True

    def close(self, timeout: float | None = None) -> ShutdownReport:
        """Stop the poller and close the client; idempotent. Nothing started: a ``no-poller`` report."""
        with self._lock:
            self.closed = True
            started, finalizer = self.started, self._finalizer
        if started is None:
            return ShutdownReport("no-poller", 0.0, None, False)
        report = started.buffer.close(timeout)
        if finalizer is not None:
            finalizer()
        return report


def _poller_source(source: SourceSpec | None, kwargs: dict[str, Any] | None,
                   partition_id: str | None) -> tuple[SourceSpec, dict[str, Any], bool]:
    """The spec and kwargs the poller lists, and whether the sampler chose the partitions it lists.

    On TransferQueue: only ``partition_id`` unless ``kwargs`` name their own
    ``partition_ids``; without an ``address``, the live controller's.
    """
    given = dict(kwargs or {})
    if not is_transferqueue(source):
        assert source is not None
        return source, given, False
    chosen = given.get("partition_ids") is None and partition_id is not None
    if chosen:
        given["partition_ids"] = [partition_id]
    return TRANSFERQUEUE, given if "address" in given else transferqueue_kwargs(None, **given), chosen


def _shut_down(buffer: ReplayBuffer, store: StoreCalls) -> None:
    """The sampler's finalizer: close its buffer, then the client it built (no reference to the sampler)."""
    try:
        buffer.close()
    finally:
        store.close()
