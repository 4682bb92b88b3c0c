"""``ReplayBuffer``: the store, the receiver and a supervised poller, composed.

::

    ReplayBuffer ── add/remove/sample ──▶ PartitionStore ◀── StreamReceiver (ROUTER)
         │                                  ▲ policies: StepSampler (sample), ...
         │                                                   ▲ DELTA/HEARTBEAT/BYE
         └── _Core ── Supervisor thread ── PollerProcess ────┘ (child, DEALER)

The facade holds only a ``_Core``, which never refers back to it, so a finalizer can close the core
when the facade is dropped: nothing outlives a forgotten buffer.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Iterable, Mapping

from buffer.access import check_bind
from buffer.checks import check_buffer_args, check_items, check_keys, check_partition, check_sample
from buffer.errors import BufferClosed
from buffer.ipcdir import PrivateIpcDir, remove_stale
from buffer.metrics import METRICS, BufferStats, collect_stats
from buffer.process import PollerProcess, ShutdownReport
from buffer.sampling import SamplingAccess
from buffer.steps import BatchMeta, StepSampler
from buffer.store import PartitionStore
from buffer.stream import StreamReceiver
from buffer.supervisor import RestartBudget, Supervisor, close_bound
from buffer.sync import ListingSync
from poller.common.checks import DEFAULT_LISTING_SHARE, check_optional_seconds
from poller.sources.contract import SourceSpec
from poller.wire.curve import CurveClient, CurveServer, generate_pair
from poller.wire.protocol import DEFAULT_LIMITS, Limits
from poller.wire.vocabulary import Tags

__all__ = ["ReplayBuffer"]

logger = logging.getLogger(__name__)

_FIRST_POLL_WAIT = 5.0

#: The least ``max_view_age=None`` lets a view age. Generous on purpose: the backstop for a poller that
#: neither completes a poll nor reports a stall (a store that does not answer is caught at its first
#: stalled or failed call).
DEFAULT_MAX_VIEW_AGE = 60.0


def default_max_view_age(poll_interval: float) -> float:
    """What ``max_view_age=None`` bounds a view's age by: 60 s, or three poll intervals if longer
    (a poller asked to list every 2 minutes is not waited for between two of its polls)."""
    return max(DEFAULT_MAX_VIEW_AGE, 3 * poll_interval)


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


class _Core:
    """Everything a buffer owns, and its close."""

    def __init__(self, source: SourceSpec | None, source_kwargs: Mapping[str, Any] | None, poll_interval: float,
                 bind: str | None, start_timeout: float, close_timeout: float, max_restarts: int,
                 restart_window: float, curve: CurveServer | None, limits: Limits | None, stale_after: float,
                 max_view_age: float, poller_options: Mapping[str, Any]) -> None:
        self.source = source
        self.poller_options = dict(poller_options)  # further WorkerConfig fields
        self.source_kwargs = dict(source_kwargs or {})
        self.poll_interval = poll_interval
        self.start_timeout = start_timeout
        self.close_timeout = close_timeout
        self.budget = RestartBudget(max_restarts, restart_window)  # spent by the supervisor
        self.store = PartitionStore(limits=limits or DEFAULT_LIMITS)
        self.store.bound_age(max_view_age)
        # Only this process may stop the poller or remove the ipc directory (a forked child inherits the finalizer).
        self.owner_pid = os.getpid()
        self.name = f"embedded-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Reentrant: a signal handler may call close() in the thread that is closing.
        self._close_lock = threading.RLock()
        self._closer: int | None = None
        self._report: ShutdownReport | None = None
        self.supervisor: Supervisor | None = None
        self._ipc_dir: PrivateIpcDir | None = None
        if bind is None:
            self._ipc_dir = PrivateIpcDir()
            bind = self._ipc_dir.endpoint
        self.child_curve: CurveClient | None = None
        if curve is not None and source is not None:
            # An ephemeral key pair for the buffer's own poller, never in a file: the secret half reaches the
            # child through its private pipe, the public half is allowed for this buffer's lifetime only.
            public, secret = generate_pair()
            self.child_curve = CurveClient(public, secret, curve.public_key)
            curve = curve.allowing(public)
        self.receiver = StreamReceiver(self.store, bind, curve=curve,
                                       stale_after=stale_after, pinned=frozenset({self.name}))
        self.store.on_removed = self.receiver.send_marks
        self.endpoint: str | None = None
        self.sampling = SamplingAccess(self.store, ListingSync(self.store, self.receiver,
                                                         self.name if source is not None else None))
        self._steps: StepSampler | None = None
        self._steps_lock = threading.Lock()
        if source is not None:
            # No decision on a view that was never whole: decisions wait for the poller's first complete listing.
            self.store.require(self.name)
        _OPEN_CORES.add(self)

    def step_sampler(self) -> StepSampler:
        """``sample()``'s step index, made and attached on the first call (``ReplayBuffer._step_index_at_start``)."""
        with self._steps_lock:
            if self._steps is None:
                self._steps = StepSampler(self.sampling)
            return self._steps

    @property
    def process(self) -> PollerProcess | None:
        """The poller child now (owned by the supervisor)."""
        return self.supervisor.process if self.supervisor is not None else None

    def start(self) -> None:
        if self.source is None:
            self.endpoint = self.receiver.start()
            remove_stale()
            return
        started = time.monotonic()
        if self._ipc_dir is not None:
            # Known before the bind, so the receiver binds while the poller's interpreter boots (the poller
            # connects ~30 ms after its spawn). Should the bind fail, start() raises and close() ends the poller.
            self.endpoint = self._ipc_dir.endpoint
        else:
            self.endpoint = self.receiver.start()
        self.supervisor = Supervisor(self.name, self._new_process, start_timeout=self.start_timeout,
                                     budget=self.budget, drained=self._drained, give_up=self.store.fail,
                                     switched=lambda: self.store.replaced(self.name))
        # Started once reachable from close(): an interrupt here must find the thread it has to stop.
        self.supervisor.start()
        if self._ipc_dir is not None and self.receiver.start() != self.endpoint:
            raise RuntimeError(f"the receiver bound {self.receiver.endpoint}, not {self.endpoint}")
        remove_stale()
        # The child's start is bounded by start_timeout; the margin covers launching it.
        self.supervisor.started.result(self.start_timeout + 30.0)
        # Return with the store's contents visible when that is quick; a slow first listing is no error:
        # every decision waits for the first complete listing itself (PartitionStore.view_gap).
        first_poll_wait = min(_FIRST_POLL_WAIT, max(0.0, self.start_timeout - (time.monotonic() - started)))
        if not self.receiver.wait_first_poll(self.name, first_poll_wait):
            logger.warning("poller %s: no complete listing within %.3gs of READY; sample() waits for it",
                           self.name, first_poll_wait)

    def include_partitions(self, partition_ids: list[str]) -> None:
        held = self.source_kwargs.get("partition_ids")
        if not isinstance(held, (list, tuple)):
            return  # the source lists every partition
        added = [p for p in dict.fromkeys(partition_ids) if p not in held]
        if not added:
            return
        # Replaced whole, never edited: the supervisor reads it for each new process.
        self.source_kwargs = {**self.source_kwargs, "partition_ids": [*held, *added]}
        self.receiver.table.include_partitions(self.name.encode(), [*held, *added])
        logger.debug("poller %s lists partitions %s too", self.name, added)

    def switch_source(self, changes: Mapping[str, Any]) -> ShutdownReport:
        with self._close_lock:  # no close() between the check and the request: the request is answered
            self.store.check_open()
            if self.supervisor is None:
                raise ValueError("this buffer has no poller of its own (source=None): there is no source to switch")
            # Replaced whole, never edited: the supervisor reads it for each new process.
            self.source_kwargs = {**self.source_kwargs, **changes}
            answer = self.supervisor.switch(self.close_timeout)
        # The ladder's two waits, the reap and the new child's spawn: bounded like close().
        return answer.result(close_bound(self.close_timeout))

    def _drained(self, process: PollerProcess, final: bool = True) -> Callable[[float], bool]:
        """Whether everything ``process`` sent before BYE was applied (asked after it exited). For the buffer's
        last poller (``final``, not one a switch replaces) the receiver ends once that BYE is applied, so
        closing its socket and removing the ipc directory overlap the poller's exit."""
        name, epoch = process.name, process.epoch
        if final:
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
        limits = self.receiver.limits
        # The poller checks tags against the receiver's whole limits, or a tag the receiver refuses would fail
        # every resync; a chunk of n keys spans at most n partitions, so 2n stays within the keys-per-message bound.
        return PollerProcess(self.source, endpoint=self.endpoint, source_kwargs=self.source_kwargs,
                             name=self.name, poll_interval=self.poll_interval,
                             orphan_cleanup=self._ipc_dir.path if self._ipc_dir else None, epoch=epoch,
                             curve=self.child_curve, max_frame_bytes=limits.max_frame_bytes, limits=limits,
                             chunk_items=max(1, min(4096, limits.max_keys_per_message // 2)), **self.poller_options)

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
            started = time.monotonic()
            report = ShutdownReport("no-poller", 0.0, None, False)
            try:
                if self.supervisor is not None:  # bounded: each stage of the ladder is
                    report = self.supervisor.close(self.close_timeout if timeout is None else timeout)
            finally:
                # Also when the supervisor did not answer (a bug, raised to the caller).
                self._closer = None
                self.store.close()
                self.receiver.stop()
                _OPEN_CORES.discard(self)
                self._remove_ipc_dir()
            self._report = report._replace(seconds=time.monotonic() - started)
            logger.debug("replay buffer closed: %s", self._report)
            return self._report


class ReplayBuffer:
    """A replay buffer of sample metadata fed by an isolated poller process.

    Args:
        source: ``"package.module:attr"`` or a picklable callable giving an object with ``kv_list()``,
            built in the poller process. ``None``: no poller; the buffer receives only from standalone
            pollers connecting to ``bind`` (and from :meth:`add`).
        source_kwargs: keyword arguments for the source factory.
        poll_interval: seconds from the start of one ``kv_list()`` to the start of the next (a longer
            poll is followed by a pause of a tenth of it; ``listing_share`` may space listings further).
        bind: endpoint to bind; default a private ``ipc://`` path in a 0700 directory removed on close.
            ``"tcp://127.0.0.1:0"`` takes a free port.
        start_timeout: seconds to wait for the poller's READY.
        close_timeout: default per-stage bound of :meth:`close`.
        max_restarts: restarts of a dead poller within ``restart_window`` seconds; the next death makes
            ``sample()`` raise :class:`~poller.PollerCrashed`. A restart refused because the store cannot
            be reached uses none: it is retried (backoff capped at 5 s) until the store answers.
        restart_window: seconds over which restarts are counted.
        curve: a :class:`~poller.wire.curve.CurveServer` (the buffer's key pair, the allowed poller public
            keys): only pollers holding an allowed key get in, the stream is encrypted, and the buffer's
            own poller gets an ephemeral key. See SECURITY.md.
        insecure: allow binding a network-reachable endpoint without ``curve`` (logged as a warning).
        limits: decoding and per-peer bounds: a :class:`~poller.wire.protocol.Limits`, or a mapping of some
            of its fields (a Hydra/OmegaConf config node).
        stale_after: seconds of silence (pollers beat every second) after which a poller is in
            ``stats()["stale_peers"]`` and a warning is logged.
        stall_timeout: seconds after which a ``kv_list()`` still running counts as a source stall
            (``None``: only stalls the source reports itself).
        max_view_age: the oldest a view (seconds since the poller's last complete poll was applied)
            :meth:`sample` decides on. Past it, or while the store does not answer (a stalled or failed
            call, a poller silent past ``stale_after``), ``sample()`` waits, and its ``TimeoutError``
            names the store and for how long. ``None``: 60 s, or three ``poll_interval`` if longer.
        poller_log_level: the level (name or number) from which poller records are re-emitted under ``poller``.
        listing_share: the most of the wall clock the poller spends in full listings of a source
            without a change feed (TransferQueue): after a listing of ``d`` seconds the next starts no
            sooner than ``max(poll_interval, d / listing_share)`` after it began, and a ``sync()`` asked
            sooner is answered by that one. In (0, 1]; 1 sets no bound. The default, 0.15, is verl's
            sampler's own share at 100k TransferQueue keys (docs/using.md, "The listing share"). A call
            that stalls or fails is not a listing.

    Raises:
        PollerStartupError: the poller could not start; nothing is left running.
        InsecureBindError: ``bind`` reaches the network without ``curve`` or ``insecure=True``.
        ValueError: a number out of range: durations must be finite (and positive, ``close_timeout`` may be 0),
            ``max_restarts`` an int >= 0.
    """

    # sample()'s step index follows every change from the start (attached to an empty store, it replays
    # nothing); a buffer that never samples by step (buffer.verl's) makes it only if sample() is called.
    _step_index_at_start = True

    def __init__(self, source: SourceSpec | None = None, *, source_kwargs: Mapping[str, Any] | None = None,
                 poll_interval: float = 1.0, bind: str | None = None, start_timeout: float = 30.0,
                 close_timeout: float = 5.0, max_restarts: int = 3, restart_window: float = 600.0,
                 curve: CurveServer | None = None, insecure: bool = False,
                 limits: Limits | Mapping[str, int] | None = None, stale_after: float = 5.0,
                 stall_timeout: float | None = 30.0, max_view_age: float | None = None,
                 poller_log_level: int | str = "WARNING",
                 listing_share: float = DEFAULT_LISTING_SHARE) -> None:
        resolved_limits, poller_options = check_buffer_args(
            poll_interval, start_timeout, close_timeout, max_restarts, restart_window, stale_after, curve, limits,
            stall_timeout, max_view_age, poller_log_level, listing_share)
        if bind is not None:  # the default, a private ipc directory, needs no check
            bind = check_bind(bind, curve, insecure)
        core = _Core(source, source_kwargs, poll_interval, bind, start_timeout, close_timeout, max_restarts,
                     restart_window, curve, resolved_limits, stale_after,
                     default_max_view_age(poll_interval) if max_view_age is None else max_view_age, poller_options)
        if self._step_index_at_start:
            core.step_sampler()
        try:
            core.start()
        except BaseException:
            core.close(min(close_timeout, 1.0))
            raise
        self._core = core
        self._finalizer = weakref.finalize(self, core.close)

    def __repr__(self) -> str:
        core = self._core
        state = "closed" if core.store.closed else "open"
        return f"<ReplayBuffer {state} endpoint={core.endpoint} keys={core.store.key_count()} poller={core.process!r}>"

    @property
    def endpoint(self) -> str:
        """The bound ZeroMQ endpoint standalone pollers connect to."""
        assert self._core.endpoint is not None
        return self._core.endpoint

    def add(self, partition_id: str, items: Mapping[str, Mapping[str, Any]]) -> None:
        """Merge tags per key (``tags.update(new)``), never replacing; all or nothing (every item is checked first).

        Raises:
            TypeError: ``partition_id`` or a key is not a str, ``items`` or a key's tags is not a mapping, or a
                tag name is not a str.
        """
        check_partition(partition_id)
        self._core.store.add(partition_id, check_items(items))

    def remove(self, partition_id: str, keys: Iterable[str]) -> None:
        """Delete keys. They stay removed while the source still lists them.

        Raises:
            TypeError: ``keys`` is one string (pass ``[key]``), or a key or ``partition_id`` is not a str;
                nothing is removed.
        """
        check_partition(partition_id)
        self._core.store.remove(partition_id, check_keys(keys))

    def sample(self, partition_id: str, global_steps: Any = None, batch_size: int | None = None,
               timeout: float | None = None) -> BatchMeta:
        """Wait for a batch; pass exactly one of ``global_steps`` and ``batch_size``. Nothing is removed.

        ``global_steps=g`` waits until no key of step ``g`` is ``"running"`` and returns the step's
        ``"success"`` keys; ``batch_size=n`` waits for ``n`` ``"success"`` keys and returns the first ``n``.

        Raises:
            TimeoutError: after ``timeout`` seconds, saying what is missing.
            PollerCrashed: the poller is dead for good.
            BufferClosed: the buffer was closed, possibly by another thread.
            ValueError: ``batch_size`` is not an int >= 1 (``True`` neither), or ``timeout``
                is not a finite number >= 0 (``None`` waits without a limit).
            TypeError: ``partition_id`` is not a str.
        """
        check_partition(partition_id)
        timeout = check_sample(global_steps, batch_size, timeout)
        return self._core.step_sampler().sample(partition_id, global_steps=global_steps, batch_size=batch_size,
                                                timeout=timeout)

    def sync(self, timeout: float | None = None) -> None:
        """Read your writes: return once a listing that began after this call has been applied.

        Asks the buffer's own poller and every standalone poller streaming to it for a poll at once
        (concurrent calls may share one); one silent past ``stale_after``, or saying BYE, is not waited for.

        Raises:
            TimeoutError: no such listing in ``timeout`` seconds (the source stalls or fails); the message says why.
            PollerCrashed: the poller is dead for good.
            BufferClosed: the buffer was closed, possibly by another thread.
            ValueError: ``timeout`` is not a finite number >= 0 (``None`` waits without a limit).
        """
        self._core.store.check_open()
        self._core.sampling.sync(check_optional_seconds("timeout", timeout, allow_zero=True))

    def include_partitions(self, partition_ids: Iterable[str]) -> None:
        """Have the poller list these partitions too, when its source lists a chosen set of them.

        For a source built with a ``partition_ids`` list (TransferQueue): the listing answering the next
        :meth:`sync` includes them, and every later one, also after a restart.

        Raises:
            TypeError: ``partition_ids`` is one string, or holds a non-str.
            BufferClosed: the buffer was closed.
        """
        self._core.store.check_open()
        if isinstance(partition_ids, (str, bytes)):
            raise TypeError(f"partition_ids must be a list of partition ids, not one string {partition_ids!r}")
        self._core.include_partitions([check_partition(p) for p in partition_ids])

    def switch_source(self, source_kwargs: Mapping[str, Any]) -> ShutdownReport:
        """Move the buffer's own poller to a replaced store: ``source_kwargs`` merged over the current ones.

        For a store replaced under the same source, such as a TransferQueue controller the trainer
        re-initialised (``tq.close()``, then ``tq.init()``: a new address)::

            rb.switch_source(transferqueue.source_kwargs(tq.init(...)))

        The poller is closed (the ladder of :meth:`close`) and a new one starts on the merged arguments,
        using no restart budget (``stats()["source_switches"]`` counts it; a store not reachable yet is
        retried with backoff). From the return on, no decision is made until the new poller's first
        complete listing is applied, dropping every key only the old store listed: no view mixes the two.
        What :meth:`add` and :meth:`remove` did stays. Returns how the old poller ended (its close report).

        Raises:
            TypeError: ``source_kwargs`` is not a mapping with str keys.
            ValueError: the buffer has no poller of its own (``source=None``).
            PollerCrashed: the poller is dead for good.
            BufferClosed: the buffer was closed, possibly while switching.
        """
        if not isinstance(source_kwargs, Mapping) or not all(isinstance(key, str) for key in source_kwargs):
            raise TypeError(f"source_kwargs must be a mapping with str keys, got {source_kwargs!r}")
        return self._core.switch_source(source_kwargs)

    @property
    def sampling(self) -> SamplingAccess:
        """What a sampling policy uses of this buffer (:class:`~buffer.sampling.SamplingAccess`): the store's
        changes under its lock, decisions on whole views with deadlines, read-your-writes, clearing."""
        return self._core.sampling

    def snapshot(self, partition_id: str | None = None) -> dict[str, Any]:
        """A deep copy of every partition, or of one."""
        return self._core.store.snapshot(partition_id)

    @property
    def partitions(self) -> dict[str, dict[str, Tags]]:
        """The same deep copy as ``snapshot()``, for code written against the old buffer."""
        return self._core.store.snapshot()  # type: ignore[return-value]

    def stats(self) -> BufferStats:
        """Counters and state of the stream and the poller (the manual: docs/using.md, "Stats")."""
        if self._core.store.closed:
            raise BufferClosed("the replay buffer is closed")
        return collect_stats(self._core)

    def metrics(self) -> dict[str, float]:
        """Numbers only, under stable dotted names (``replay.keys``, ...), fit to pass to a tracker as it is;
        :data:`buffer.metrics.METRICS` lists them."""
        stats = self.stats()
        return {metric.name: metric.read(stats) for metric in METRICS}

    def close(self, timeout: float | None = None) -> ShutdownReport:
        """Stop the poller and release everything; returns how it ended.

        STOP, wait up to ``timeout`` (default ``close_timeout``) for BYE and exit, then ``terminate()``, wait,
        then ``kill()``. Idempotent and thread-safe: every caller gets the same report. In a forked child it
        touches nothing of the parent's (stage ``"no-poller"``).

        Raises:
            ValueError: ``timeout`` is not a finite number of seconds >= 0.
        """
        check_optional_seconds("timeout", timeout, allow_zero=True)
        report = self._core.close(timeout)
        self._finalizer.detach()
        return report

    def __enter__(self) -> "ReplayBuffer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
