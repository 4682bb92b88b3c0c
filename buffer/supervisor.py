"""The one owner of a buffer's poller child: it starts, watches, restarts and closes it.

::

    constructor ── started (future) ◀──┐
    close()  ── CloseRequest + poke ──▶ supervisor thread ── PollerProcess (start, sentinel, close ladder)
             ◀── report (future) ──────┘        └── restarts, then PollerCrashed to the store

One thread at a time touches the child. A close that finds the thread only
watching a running child takes the child over: the closing thread runs the
ladder (:meth:`~poller.PollerProcess.close`) itself, so its STOP goes out
without a hand-off between threads (~0.2 ms of an idle close of ~4), and
the supervisor thread ends at once, restarting nothing. At any other moment
(a start, a restart, its backoff) a close is a request, answered through a
future once the thread has run the ladder, the way CPython's process-pool
manager thread serves its executor; a request that arrives while a
restarted child is still starting cuts that start short (the child is
killed), so a close never waits out a start timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple

from poller.errors import PollerCrashed, PollerStartupError
from poller.launch import wait
from poller.process import PollerProcess, ShutdownReport
from poller.wakeup import WakePipe

from .restarts import RestartBudget

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)


class _CloseRequest(NamedTuple):
    timeout: float
    report: "Future[ShutdownReport]"


class _HandedOver:
    """What the thread's watch ends with when a closing thread took the child over."""


_HANDED_OVER = _HandedOver()


class Supervisor:
    """Runs one poller child at a time for a buffer, restarting it within ``budget``.

    ``new_process()`` makes the next (unstarted) child; ``drained(process)``
    says, after its exit, whether everything it sent was applied;
    ``give_up(error)`` is told when the budget is used up
    (:mod:`buffer.restarts`: restarts per window; a start-up refused because
    the store is unreachable uses none and is tried again with backoff).
    """

    def __init__(self, name: str, new_process: Callable[[], PollerProcess], *, start_timeout: float,
                 budget: RestartBudget, drained: Callable[[PollerProcess], Callable[[float], bool]],
                 give_up: Callable[[PollerCrashed], None]) -> None:
        self.name = name
        self._new_process = new_process
        self._start_timeout = start_timeout
        self._budget = budget
        self._drained = drained
        self._give_up = give_up
        #: The child now (read by stats() from any thread; written by the supervisor only).
        self.process: PollerProcess | None = None
        #: Restarts refused by an unreachable store (they use no budget).
        self.start_retries = 0
        #: Done once the first child said READY (or failed to: PollerStartupError).
        self.started: Future[None] = Future()
        self._requests: queue.SimpleQueue[_CloseRequest] = queue.SimpleQueue()
        self._wake = WakePipe()
        # The running child the thread only watches (None at any other moment), and whether a
        # closing thread took it over; both under the lock.
        self._state = threading.Lock()
        self._watched: PollerProcess | None = None
        self._handed_over = False
        self._thread = threading.Thread(target=self._run, name="replay-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float) -> Future[ShutdownReport]:
        """Close the child with the ladder's ``timeout``; the report comes in the future.

        When the thread only watches a running child, the ladder runs here and
        the future is done on return; otherwise the thread runs it.
        """
        if threading.current_thread() is not self._thread:
            with self._state:
                process = self._watched
                if process is not None:
                    self._handed_over = True
            if process is not None:
                # The thread wakes as the child exits (its sentinel) and ends; woken now, it
                # took the GIL from this thread at every system call up to STOP. Woken after
                # the ladder anyway, for a child whose exit it did not see.
                report: Future[ShutdownReport] = Future()
                report.set_result(self._close(process, timeout))
                self._wake.poke()
                return report
        request = _CloseRequest(timeout, Future())
        self._requests.put(request)
        self._wake.poke()
        if threading.current_thread() is self._thread:
            # A finalizer run by a garbage collection in this very thread
            # cannot wait for this thread: it is served here, by the owner.
            request.report.set_result(self._close_child(timeout))
        return request.report

    def wait_closed(self, report: Future[ShutdownReport], timeout: float) -> ShutdownReport:
        """Wait up to ``timeout`` for the answer to a close request, and for the thread to end.

        Raises:
            concurrent.futures.TimeoutError: no answer within ``timeout`` (a bug).
        """
        deadline = time.monotonic() + timeout
        if threading.current_thread() is not self._thread:
            # The thread ends right after it answers: waiting for its end is one
            # wake-up of the caller, where waiting for the answer and then
            # joining was two (0.9 ms of an idle close() of 7.3, medians of 31
            # on a loaded 2-core machine).
            self._thread.join(timeout)
        answer = report.result(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            self._wake.close()
        return answer

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- the thread -----------------------------------------------------------------

    def _run(self) -> None:
        request: _CloseRequest | _HandedOver | None = None
        try:
            request = self._own()
        except BaseException as exc:  # a bug here must not leave a close() waiting for ever
            logger.exception("the supervisor of poller %s failed", self.name)
            if not self.started.done():
                self.started.set_exception(exc)
        if isinstance(request, _HandedOver):
            return  # the closing thread runs the ladder
        if request is None:
            request = self._requests.get()
        report = self._close_child(request.timeout)  # the ladder runs once; later calls get its report
        while True:  # later requests (there should be none) get the same answer
            if not request.report.done():
                request.report.set_result(report)
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                return

    def _own(self) -> _CloseRequest | _HandedOver | None:
        """Start, watch and restart the child until a close comes; return its request (or the hand-over)."""
        process = self.process = self._new_process()
        try:
            process.start(self._start_timeout, abort_fd=self._wake.read_fd)
        except PollerStartupError as exc:
            self.started.set_exception(exc)
            return None
        self.started.set_result(None)
        while True:
            request = self._watch(process)
            if request is not None:
                return request
            exitcode = process.join(5.0)
            cause = process.fatal_error()
            process.close(0)  # reap; the stage is "already-exited"
            logger.warning("poller %s (pid %s) exited with code %s%s", self.name, process.pid, exitcode,
                           f": {cause.exc_type}: {cause.message}" if cause else "")
            started = self._restart(exitcode, cause)
            if not isinstance(started, PollerProcess):
                return started
            process = started

    def _restart(self, exitcode: int | None, cause: Exception | None) -> PollerProcess | _CloseRequest | None:
        """A started new child; or the close request that came first; or None once given up."""
        budget = self._budget
        refused = 0  # start-ups in a row refused because the store could not be reached
        while refused or not budget.exhausted():
            request = self._wait(None, budget.unavailable_backoff(refused) if refused else budget.backoff())
            if request is not None:
                return request
            process = self.process = self._new_process()
            budget.use()  # before it starts: its data may arrive before start() returns
            try:
                process.start(self._start_timeout, abort_fd=self._wake.read_fd)
            except PollerStartupError as exc:
                if not self._requests.empty():
                    return self._requests.get()
                if exc.unavailable:  # retried without using the budget (buffer/restarts.py)
                    budget.refund()
                    refused += 1
                    self.start_retries += 1
                    logger.log(logging.WARNING if refused == 1 else logging.DEBUG,
                               "poller %s cannot start, its store is unavailable (try %d, next in %.3gs; "
                               "this uses no restart): %s", self.name, refused, budget.unavailable_backoff(refused),
                               exc)
                    continue
                refused = 0
                logger.warning("restart %d/%d of poller %s failed: %s", budget.recent(), budget.max_restarts,
                               self.name, exc)
                cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
                continue
            logger.warning("poller %s restarted (%d/%d in %gs), pid %s", self.name, budget.recent(),
                           budget.max_restarts, budget.window, process.pid)
            return process
        error = PollerCrashed(f"poller {self.name} died (exit code {exitcode}) and "
                              f"max_restarts={budget.max_restarts} restarts within {budget.window:g}s were used")
        error.__cause__ = cause
        logger.error("%s", error)
        self._give_up(error)
        return None

    def _watch(self, process: PollerProcess) -> _CloseRequest | _HandedOver | None:
        """Until the running ``process`` exits (None), a close request comes, or a closing thread takes it over."""
        with self._state:
            self._watched = process
        try:
            request = self._wait(process.sentinel, None)
        finally:
            with self._state:
                self._watched = None
                handed_over = self._handed_over
        # Taken over (also just as it exited): the closing thread alone touches it from now on.
        return _HANDED_OVER if handed_over else request

    def _wait(self, sentinel: int | None, timeout: float | None) -> _CloseRequest | None:
        """Until ``sentinel`` is readable or ``timeout`` passes (None); a close ends it early."""
        fds = [self._wake.read_fd] + ([] if sentinel is None else [sentinel])
        while True:
            try:
                return self._requests.get_nowait()
            except queue.Empty:
                pass
            if self._handed_over:
                return None
            ready = wait(fds, timeout)
            if self._wake.read_fd in ready:
                self._wake.drain()
                continue
            return None

    def _close_child(self, timeout: float) -> ShutdownReport:
        process = self.process
        if process is None:
            return ShutdownReport("no-poller", 0.0, None, False)
        return self._close(process, timeout)

    def _close(self, process: PollerProcess, timeout: float) -> ShutdownReport:
        return process.close(timeout, wait_drained=self._drained(process))
