"""The verl sampler's buffer and store client: started on its first call, shut down together.

Constructing :class:`buffer.verl.ReplayBuffer` does no I/O, so a trainer
whose constructor fails after building it leaks nothing. The sampler's first
``sample`` / ``wait_for_sampleable`` / ``get_sampleable_count`` calls
:meth:`SamplerLifecycle.start`: it starts the buffer (its poller), attaches
the sampler's :class:`~buffer.groups.GroupIndex`, and opens the client of the
sampler's own clears and reads (:mod:`buffer.verl_client`). verl never calls
``close()``: a finalizer shuts both down when the sampler is dropped, or at
the interpreter's exit.

On TransferQueue the poller lists only the partitions the sampler is asked
about, which join the set one call at a time (:meth:`SamplerLifecycle.include`),
and, as verl's own sampler, only when a call needs it: the poller's own
schedule is :data:`QUIET_POLL_INTERVAL` and the sampler asks for every
listing it needs (:attr:`SamplerLifecycle.lists_between_calls`).

On TransferQueue the poller follows the controller of the trainer's
TransferQueue client, as verl's own sampler does (it lists through the
``transfer_queue`` module's current client on every call): each call first
asks :meth:`SamplerLifecycle.follow`, which compares that client's controller
address with the one the poller lists, two attribute reads, and on a
difference (the trainer ran ``tq.close()`` and ``tq.init()``: a new
controller on a new port) moves the poller there
(:meth:`buffer.ReplayBuffer.switch_source`: no crash, no restart budget).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from buffer import verl_client
from buffer.errors import BufferClosed
from buffer.groups import GroupIndex
from buffer.process import ShutdownReport
from buffer.replay import ReplayBuffer
from buffer.seam import SamplingSeam
from buffer.verl_config import SamplerConfig

__all__ = ["QUIET_POLL_INTERVAL", "SamplerLifecycle", "Started"]

logger = logging.getLogger(__name__)

#: The poller's own schedule when it does not list between calls: the calls ask for every listing
#: they need (a SYNC), and the store is not listed while the trainer trains.
QUIET_POLL_INTERVAL = 3600.0


@dataclass
class Started:
    """A started sampler: its buffer, the buffer's seam, and the store client of its own clears and reads."""

    buffer: ReplayBuffer
    seam: SamplingSeam
    client: Any
    # Whether a clear must be checked by listing (verl_client.clear_is_all_or_nothing).
    verify_clears: bool = False


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
        self.lists_between_calls = (config.list_between_calls if config.list_between_calls is not None
                                    else not verl_client.is_transferqueue(config.source))
        self.started: Started | None = None
        self.closed = False
        self._finalizer: weakref.finalize | None = None
        # The partitions the poller lists, when the sampler chose them (None: the source's own choice, or all).
        self._listed: set[str] | None = None
        # On TransferQueue: the controller address the poller lists, and the client's controller info last
        # compared with it (the same object again needs no comparison).
        self._follows = verl_client.is_transferqueue(config.source)
        self._address: str | None = None
        self._compared: Any = None

    def start(self, partition_id: str | None = None) -> Started:
        """The buffer and client, started on first use; the poller lists ``partition_id`` (see :meth:`include`).

        verl's calls start it through the sampler's decisions, which name the
        partition; started without one, the poller lists every partition.

        Raises:
            BufferClosed: the sampler was closed.
        """
        with self._lock:
            if self.closed:
                raise BufferClosed("the sampler is closed")
            if self.started is not None:
                return self.started
            config = self._config
            spec, kwargs, chosen = verl_client.poller_source(config.source, config.source_kwargs, partition_id)
            self._listed = {partition_id} if chosen and partition_id is not None else None
            self._address = kwargs.get("address") if self._follows else None
            client, owned = verl_client.open_client(config.source, config.source_kwargs,
                                                    need_fields=config.filter_groups_metric is not None)
            try:
                interval = config.poll_interval if self.lists_between_calls else QUIET_POLL_INTERVAL
                buffer = ReplayBuffer(spec, source_kwargs=kwargs, poll_interval=interval, **config.buffer_kwargs)
            except BaseException:
                verl_client.shut_down(None, client, owned)
                raise
            # Tied to this object, which only the sampler holds (its arguments hold neither): dropping
            # the sampler runs it.
            self._finalizer = weakref.finalize(self, verl_client.shut_down, buffer, client, owned)
            try:
                buffer.seam.attach(self._index)
            except BaseException:
                self._finalizer()
                raise
            started = self.started = Started(buffer, buffer.seam, client)
            started.verify_clears = verl_client.clear_is_all_or_nothing(client,
                                                                        verl_client.is_transferqueue(config.source))
            logger.debug("verl sampler started: %r", buffer)
            return started

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

        A no-op (two attribute reads) while that client is the one compared
        before, or names the controller the poller lists; also without a
        client (after ``tq.close()``, before the next ``tq.init()``: the poller
        keeps its controller and its listings stall). On a new controller the
        poller is switched to it (:meth:`buffer.ReplayBuffer.switch_source`):
        once this returns no decision is made until the new controller's first
        complete listing is applied, which drops every key of the old one.
        True when it moved: the caller's next decision must wait for a listing.

        Raises:
            BufferClosed, PollerCrashed: from the switch.
        """
        started = self.started
        if started is None or not self._follows:
            return False
        info = verl_client.live_controller(started.client)
        with self._lock:
            if info is None or info is self._compared:
                return False
            self._compared = info
            changes = verl_client.controller_kwargs(info)
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
        ``"val"`` while it validates), so the poller starts with the first
        call's partition and each new one joins the set here. True when it
        joined: the sampler's next decision must then wait for a listing that
        includes it (read your writes).
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
