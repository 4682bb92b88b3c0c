"""``_Core``: everything a :class:`~buffer.ReplayBuffer` owns, and its close.

The facade (:mod:`buffer.replay`) holds only a core, so a finalizer can
close it when the facade is dropped. The poller child has one owner,
:class:`~buffer.supervisor.Supervisor`, which ``close()`` asks (or takes a
running child over from).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import uuid
from typing import Any, Callable, Mapping

from buffer.ipcdir import PrivateIpcDir, remove_stale
from buffer.partitions import PartitionStore
from buffer.process import PollerProcess, ShutdownReport
from buffer.seam import SamplingSeam
from buffer.steps import StepSampler
from buffer.stream import StreamReceiver
from buffer.supervisor import RestartBudget, Supervisor, close_bound
from buffer.sync import ListingSync
from poller.wire.curve import CurveClient, CurveServer, generate_pair
from poller.wire.protocol import DEFAULT_LIMITS, Limits
from poller.wire.sources import SourceSpec

__all__ = ["_Core"]

logger = logging.getLogger(__name__)

_FIRST_POLL_WAIT = 5.0


# Buffers not closed yet, closed at interpreter exit *before* non-daemon threads are joined (the hook
# concurrent.futures uses): a thread waiting in sample(timeout=None) would otherwise block that join for ever.
_OPEN_CORES: "set[_Core]" = set()


def _close_open_buffers() -> None:
    for core in list(_OPEN_CORES):
        try:
            core.close()
        except Exception:  # one buffer's failure must not keep the others open
            logger.exception("closing a replay buffer at exit failed")


threading._register_atexit(_close_open_buffers)  # type: ignore[attr-defined]


def poller_limits(limits: Limits) -> dict[str, Any]:
    """Message sizes and bounds for the buffer's own poller that its receiver accepts.

    A chunk of n keys spans at most n partitions, so 2n stays within the
    keys-per-message bound. The poller checks tags against the whole
    ``limits``, or a tag the receiver refuses would fail every resync.
    """
    return {"max_frame_bytes": limits.max_frame_bytes, "limits": limits,
            "chunk_items": max(1, min(4096, limits.max_keys_per_message // 2))}


class _Core:
    """Everything a buffer owns. Never refers back to the facade."""

    def __init__(self, source: SourceSpec | None, source_kwargs: Mapping[str, Any] | None, poll_interval: float,
                 bind: str | None, start_timeout: float, close_timeout: float, max_restarts: int,
                 curve: CurveServer | None = None, limits: Limits | None = None, stale_after: float = 5.0,
                 poller_options: Mapping[str, Any] | None = None, restart_window: float = 600.0) -> None:
        self.source = source
        self.poller_options = dict(poller_options or {})  # further WorkerConfig fields
        self.source_kwargs = dict(source_kwargs or {})
        self.poll_interval = poll_interval
        self.start_timeout = start_timeout
        self.close_timeout = close_timeout
        self.budget = RestartBudget(max_restarts, restart_window)  # spent by the supervisor
        self.store = PartitionStore()
        # Only this process may stop the poller or remove the ipc directory (a forked child inherits the finalizer).
        self.owner_pid = os.getpid()
        self.name = f"embedded-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Reentrant: a signal handler may call close() in the thread that is closing.
        self._close_lock = threading.RLock()
        self._closer: int | None = None
        self._report: ShutdownReport | None = None
        self._supervisor: Supervisor | None = None
        self._ipc_dir: PrivateIpcDir | None = None
        if bind is None:
            # Private by default: a 0700 directory only this user can enter.
            self._ipc_dir = PrivateIpcDir.create()
            bind = self._ipc_dir.endpoint
        self.child_curve: CurveClient | None = None
        if curve is not None and source is not None:
            # An ephemeral key pair for the buffer's own poller, never in a file: the secret half reaches the
            # child through its private pipe, the public half is allowed for this buffer's lifetime only.
            public, secret = generate_pair()
            self.child_curve = CurveClient(public, secret, curve.public_key)
            curve = curve.allowing(public)
        self.receiver = StreamReceiver(self.store, bind, limits=limits or DEFAULT_LIMITS, curve=curve,
                                       stale_after=stale_after, pinned=frozenset({self.name}))
        self.endpoint: str | None = None
        self.listing_sync = ListingSync(self.store, self.receiver, self.name if source is not None else None)
        # What every sampling policy uses of this buffer, the step sampler behind sample() first.
        self.seam = SamplingSeam(self.store, self.listing_sync)
        self.steps = StepSampler(self.seam)
        if source is not None:
            # No decision on a view that was never whole: decisions wait for the poller's first complete listing.
            self.store.require(self.name)
        _OPEN_CORES.add(self)

    @property
    def process(self) -> PollerProcess | None:
        """The poller child now (owned by the supervisor)."""
        return self._supervisor.process if self._supervisor is not None else None

    @property
    def start_retries(self) -> int:
        """Restarts refused by an unreachable store (they use no budget)."""
        return self._supervisor.start_retries if self._supervisor is not None else 0

    @property
    def source_switches(self) -> int:
        """Deliberate restarts of the poller on new source arguments (:meth:`switch_source`)."""
        return self._supervisor.switches if self._supervisor is not None else 0

    def start(self) -> None:
        if self.source is None:
            self.endpoint = self.receiver.start()
            remove_stale()
            return
        started = time.monotonic()
        if self._ipc_dir is not None:
            # The endpoint is known before the bind: the poller's interpreter starts first and the
            # receiver binds while it boots (~1.3 ms of ~85; the poller connects ~30 ms after its spawn).
            # Should the bind fail, start() raises and close() ends the poller.
            self.endpoint = self._ipc_dir.endpoint
        else:
            self.endpoint = self.receiver.start()
        self._supervisor = Supervisor(self.name, self._new_process, start_timeout=self.start_timeout,
                                      budget=self.budget, drained=self._drained, give_up=self.store.fail,
                                      switched=self._switched)
        self._supervisor.start()
        if self._ipc_dir is not None and self.receiver.start() != self.endpoint:
            raise RuntimeError(f"the receiver bound {self.receiver.endpoint}, not {self.endpoint}")
        remove_stale()
        # The child's start is bounded by start_timeout; the margin covers launching it.
        self._supervisor.started.result(self.start_timeout + 30.0)
        # Return with the store's contents visible when that is quick; a slow first listing is no error:
        # every decision waits for the first complete listing itself (PartitionStore.view_gap).
        first_poll_wait = min(_FIRST_POLL_WAIT, max(0.0, self.start_timeout - (time.monotonic() - started)))
        if not self.receiver.wait_first_poll(self.name, first_poll_wait):
            logger.warning("poller %s: no complete listing within %.3gs of READY; sample() waits for it",
                           self.name, first_poll_wait)

    def include_partitions(self, partition_ids: list[str]) -> None:
        """Have the poller list these partitions too, when its source lists a chosen set (``partition_ids``).

        Every SYNC from now on names them, and a poller process started from
        now on lists them from its first listing.
        """
        held = self.source_kwargs.get("partition_ids")
        if not isinstance(held, (list, tuple)):
            return
        held = list(held)
        added = [p for p in dict.fromkeys(partition_ids) if p not in held]
        if not added:
            return
        # Replaced whole, never edited: the supervisor reads it for each new process.
        self.source_kwargs = {**self.source_kwargs, "partition_ids": held + added}
        self.receiver.table.include_partitions(self.name.encode(), held + added)
        logger.debug("poller %s lists partitions %s too", self.name, added)

    def switch_source(self, changes: Mapping[str, Any]) -> ShutdownReport:
        """Restart the poller on ``source_kwargs`` updated with ``changes``; how the old one ended.

        Returns once the old poller is closed and the view is marked not
        whole; the new poller starts meanwhile in the supervisor's thread.
        Raises as :meth:`buffer.ReplayBuffer.switch_source` says.
        """
        with self._close_lock:  # no close() between the check and the request: the request is answered
            self.store.check_open()
            if self._supervisor is None:
                raise ValueError("this buffer has no poller of its own (source=None): there is no source to switch")
            # Replaced whole, never edited: the supervisor reads it for each new process.
            self.source_kwargs = {**self.source_kwargs, **changes}
            answer = self._supervisor.switch(self.close_timeout)
        # The ladder's two waits, the reap and the new child's spawn: bounded like close().
        return answer.result(close_bound(self.close_timeout))

    def _switched(self) -> None:
        """The old poller of a switch is closed and the new one built (its late messages are dropped from
        now on): no decision until the new poller's first complete listing (PartitionStore.replaced)."""
        self.store.replaced(self.name)

    def _drained(self, process: PollerProcess, final: bool = True) -> Callable[[float], bool]:
        """Whether everything ``process`` sent before BYE was applied (asked after it exited).

        ``final``: the buffer's last poller (the receiver may end after its BYE); otherwise one a switch replaces.
        """
        name, epoch = process.name, process.epoch
        if not final:
            return lambda seconds: self.receiver.wait_bye(name, epoch, seconds)
        # The receiver ends once that BYE is applied: closing its socket and removing the ipc directory
        # (0.4-1.8 ms on ext4) then overlap the poller's exit instead of following it.
        self.receiver.stop_after_bye(name, epoch, then=self._remove_ipc_dir)
        return lambda seconds: self.receiver.wait_bye(name, epoch, seconds)

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            self._ipc_dir.remove()

    def _new_process(self) -> PollerProcess:
        assert self.source is not None and self.endpoint is not None
        # Chosen here, so the receiver knows it before the child's first message: anyone else using the name is refused.
        epoch = secrets.randbits(62) + 1
        self.receiver.expect(self.name, epoch)
        return PollerProcess(self.source, endpoint=self.endpoint, source_kwargs=self.source_kwargs,
                             name=self.name, interval=self.poll_interval,
                             orphan_cleanup=self._ipc_dir.path if self._ipc_dir else None,
                             epoch=epoch, curve=self.child_curve, **poller_limits(self.receiver.limits),
                             **self.poller_options)

    # -- close ------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> ShutdownReport:
        if os.getpid() != self.owner_pid:
            # A forked child's copy: everything is the parent's. Touch nothing, take no lock
            # (a thread that held it at the fork does not exist here).
            return ShutdownReport("no-poller", 0.0, None, False)
        with self._close_lock:
            if self._report is not None:
                return self._report
            me = threading.get_ident()
            if self._closer == me:
                # A signal handler interrupted this thread's own close(): it goes on once the handler returns.
                logger.warning("close() called again while this thread is closing the buffer; not waiting")
                return ShutdownReport("closing", 0.0, None, False)
            self._closer = me
            try:
                self._report = self._close(self.close_timeout if timeout is None else timeout)
            finally:
                self._closer = None
            return self._report

    def _close(self, timeout: float) -> ShutdownReport:
        started = time.monotonic()
        supervisor = self._supervisor
        report = ShutdownReport("no-poller", 0.0, None, False)
        try:
            if supervisor is not None:
                report = supervisor.close(timeout)  # bounded: each stage of the ladder is
        finally:
            # Also when the supervisor did not answer (a bug, raised to the caller).
            self.store.close()
            self.receiver.stop()
            _OPEN_CORES.discard(self)
            self._remove_ipc_dir()
        report = report._replace(seconds=time.monotonic() - started)
        logger.debug("replay buffer closed: %s", report)
        return report
