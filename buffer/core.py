"""``_Core``: everything a :class:`~buffer.ReplayBuffer` owns, and its close.

The facade (:mod:`buffer.replay`) holds only a core, so a finalizer can
close it when the facade is dropped; open cores are also closed at
interpreter exit, before non-daemon threads are joined. The poller child has
one owner, :class:`~buffer.supervisor.Supervisor`: the core's ``close()``
takes a running child over from it (or, during a start or a restart, asks it
and waits for its answer).
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
from buffer.restarts import RestartBudget
from buffer.seam import SamplingSeam
from buffer.steps import StepSampler
from buffer.stream import StreamReceiver
from buffer.supervisor import Supervisor
from buffer.sync import ListingSync
from poller.wire.curve import CurveClient, CurveServer, generate_pair
from poller.wire.protocol import DEFAULT_LIMITS, Limits
from poller.wire.sources import SourceSpec

__all__ = ["_Core"]

logger = logging.getLogger(__name__)

_FIRST_POLL_WAIT = 5.0
# Beyond the close ladder's own two waits: the reap after SIGKILL (5 s at most) and slack.
_CLOSE_MARGIN_S = 10.0


# Buffers not closed yet. Closed at interpreter exit *before* non-daemon
# threads are joined (the hook concurrent.futures uses): a non-daemon thread
# waiting in sample(timeout=None) would otherwise keep the interpreter from
# ever reaching atexit handlers and finalizers, which run after that join.
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
    keys-per-message bound. The whole ``limits`` go along too: the poller
    checks tags against the receiver's string, item and depth bounds, or a
    tag the receiver refuses would fail every resync, for good.
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
        # Only this process may stop the poller or remove the ipc directory:
        # a forked child inherits this object and its finalizer.
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
        self.receiver = self._secure_receiver(bind, curve, limits, stale_after)
        self.endpoint: str | None = None
        self.listing_sync = ListingSync(self.store, self.receiver, self.name if source is not None else None)
        # What every sampling policy uses of this buffer, the step sampler behind sample() first.
        self.seam = SamplingSeam(self.store, self.listing_sync)
        self.steps = StepSampler(self.seam)
        if source is not None:
            # No decision on a view that was never whole: sample() and the
            # verl sampler wait for the poller's first complete listing.
            self.store.require(self.name)
        _OPEN_CORES.add(self)

    def _secure_receiver(self, bind: str, curve: CurveServer | None, limits: Limits | None,
                         stale_after: float) -> StreamReceiver:
        """The receiver; with CURVE, the buffer's own poller gets an ephemeral key.

        The ephemeral key pair never touches a file: the secret half reaches
        the child inside its spawn arguments (a private pipe), and the public
        half is allowed for this buffer's lifetime only.
        """
        if curve is not None and self.source is not None:
            public, secret = generate_pair()
            self.child_curve = CurveClient(public, secret, curve.public_key)
            curve = curve.allowing(public)
        return StreamReceiver(self.store, bind, limits=limits or DEFAULT_LIMITS, curve=curve,
                              stale_after=stale_after, pinned=frozenset({self.name}))

    @property
    def process(self) -> PollerProcess | None:
        """The poller child now (owned by the supervisor; read-only here)."""
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
            # The buffer's own fresh ipc directory: the endpoint is known before the bind, so
            # the poller's interpreter starts first, and the receiver binds and stale
            # directories are cleaned while it boots (~1.3 ms of a start of ~85). The poller
            # connects once it has imported zmq, ~30 ms after the spawn (were the bind later,
            # ZeroMQ would connect at its next retry). Should the bind fail, start() raises
            # and close() ends the poller.
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
        # Return with the store's current contents visible when that is quick.
        # A store whose first listing is slow (a million keys) is not an
        # error, and the wait here stays capped: every decision waits for
        # the first complete listing itself (PartitionStore.view_gap), so
        # no answer comes from a view applied half-way.
        first_poll_wait = min(_FIRST_POLL_WAIT, max(0.0, self.start_timeout - (time.monotonic() - started)))
        if not self.receiver.wait_first_poll(self.name, first_poll_wait):
            logger.warning("poller %s: no complete listing within %.3gs of READY; sample() waits for it",
                           self.name, first_poll_wait)

    def include_partitions(self, partition_ids: list[str]) -> None:
        """Have the poller list these partitions too, when its source lists a chosen set (``partition_ids``).

        The next SYNC names them (and every later one: a poller that
        restarted before answering is asked again), and a poller process
        started from now on lists them from its first listing. A source
        without a ``partition_ids`` list lists every partition already.
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
        self.receiver.table.syncs.include_partitions(self.name.encode(), held + added)
        logger.debug("poller %s lists partitions %s too", self.name, added)

    def switch_source(self, changes: Mapping[str, Any]) -> ShutdownReport:
        """Restart the poller on ``source_kwargs`` updated with ``changes``; how the old one ended.

        Returns once the old poller is closed and the view is marked not
        whole; the new poller starts meanwhile in the supervisor's thread.

        Raises:
            BufferClosed: the buffer was closed (also while the switch was under way).
            PollerCrashed: the poller is dead for good.
            ValueError: the buffer has no poller of its own.
        """
        with self._close_lock:  # no close() between the check and the request: the request is answered
            self.store.check_open()
            if self._supervisor is None:
                raise ValueError("this buffer has no poller of its own (source=None): there is no source to switch")
            # Replaced whole, never edited: the supervisor reads it for each new process.
            self.source_kwargs = {**self.source_kwargs, **changes}
            answer = self._supervisor.switch(self.close_timeout)
        # The ladder's two waits, the reap and the new child's spawn: bounded like close().
        return answer.result(2 * self.close_timeout + _CLOSE_MARGIN_S)

    def _switched(self) -> None:
        """The old poller of a switch is closed and the new one built: its keys go, and no decision is made
        until the new poller's first complete listing is applied (:meth:`~buffer.partitions.PartitionStore.replaced`).

        Called once the old process's late messages are dropped (the new one
        is expected), so none of them can bring a key back or end the wait.
        """
        self.store.replaced(self.name)

    def _drained(self, process: PollerProcess, final: bool = True) -> Callable[[float], bool]:
        """Whether everything ``process`` sent before BYE was applied (asked after it exited).

        ``final``: the buffer's last poller (the receiver may end after its BYE); otherwise one a switch replaces.
        """
        name, epoch = process.name, process.epoch
        if not final:
            return lambda seconds: self.receiver.wait_bye(name, epoch, seconds)
        # Let the receiver end once that BYE is applied: closing its socket, and
        # removing the ipc directory nobody will connect to any more, then
        # overlap the poller's exit instead of following it. (The removal waits
        # on the file system's journal: 0.4-1.8 ms of an idle close() on ext4,
        # medians of 21.)
        self.receiver.stop_after_bye(name, epoch, then=self._remove_ipc_dir)
        return lambda seconds: self.receiver.wait_bye(name, epoch, seconds)

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            self._ipc_dir.remove()

    def _new_process(self) -> PollerProcess:
        assert self.source is not None and self.endpoint is not None
        # The epoch is chosen here, not by the child, so the receiver knows it
        # before the child's first message: anyone else using the name is refused.
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
            # A forked child's copy (its finalizer at exit, or a `with` block
            # unwinding in it): the poller, its lifeline, the sockets and the
            # ipc directory are the parent's. Touch nothing, take no lock (a
            # thread that held it at the fork does not exist here).
            return ShutdownReport("no-poller", 0.0, None, False)
        with self._close_lock:
            if self._report is not None:
                return self._report
            me = threading.get_ident()
            if self._closer == me:
                # A signal handler interrupted this thread's own close(): waiting
                # for that close would wait for ourselves forever (it did, with a
                # plain lock). It goes on once the handler returns.
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
                # The ladder (here, or in the supervisor's thread): STOP, terminate,
                # kill, each bounded, so this wait is too (the margin covers the reap
                # and a start it cuts short).
                report = supervisor.wait_closed(supervisor.close(timeout), 2 * timeout + _CLOSE_MARGIN_S)
        finally:
            # Also when the supervisor did not answer (a bug, raised to the
            # caller): the socket, the waiters and the ipc directory go.
            self.store.close()
            self.receiver.stop()
            _OPEN_CORES.discard(self)
            self._remove_ipc_dir()
        report = report._replace(seconds=time.monotonic() - started)
        logger.debug("replay buffer closed: %s", report)
        return report
