"""The one owner of a buffer's poller child: it starts, watches, restarts and closes it.

::

    constructor ── started (future) ◀──┐
    close()  ── CloseRequest + poke ──▶ supervisor thread ── PollerProcess (start, sentinel, close ladder)
    switch() ── SwitchRequest + poke ──┘        ├── restarts, then PollerCrashed to the store
                                                └── a switch: the ladder, a new child (no budget)

One thread at a time touches the child. A close that finds the thread only watching a running child
takes it over and runs the ladder itself (STOP goes out without a hand-off between threads); at any other
moment (a start, a restart, its backoff) it asks the thread, cutting a start under way short. Restarts
are counted in a sliding window (:class:`RestartBudget`), so a crash after hours of health finds the
budget whole; a start refused because the store could not be reached, and a switch, use none.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple

from buffer.errors import BufferClosed
from buffer.process import PollerProcess, ShutdownReport, wait
from poller.common.wakeup import WakePipe
from poller.wire.errors import PollerCrashed, PollerStartupError

__all__ = ["Supervisor", "RestartBudget", "close_bound"]

logger = logging.getLogger(__name__)

RESTART_BACKOFF_BASE = 0.1
RESTART_BACKOFF_CAP = 2.0
UNAVAILABLE_BACKOFF_CAP = 5.0
# Beyond the close ladder's own two waits: the reap after SIGKILL (5 s at most) and slack.
_CLOSE_MARGIN_S = 10.0


def close_bound(timeout: float) -> float:
    """How long a close (or a switch) with the ladder's ``timeout`` per stage may take."""
    return 2 * timeout + _CLOSE_MARGIN_S


class RestartBudget:
    """``max_restarts`` restarts per ``window`` seconds, and the waits between tries."""

    def __init__(self, max_restarts: int, window: float) -> None:
        self.max_restarts = max_restarts
        self.window = window
        self.total = 0  # every restart in the buffer's lifetime (stats()["restarts"]): it only grows
        self._times: collections.deque[float] = collections.deque()
        # The last restart counted was refunded (its store refused it): the next try is the same restart.
        self._refunded = False

    def recent(self) -> int:
        """Restarts within the last ``window`` seconds."""
        horizon = time.monotonic() - self.window
        while self._times and self._times[0] <= horizon:
            self._times.popleft()
        return len(self._times)

    def use(self) -> None:
        """Count one restart now; tries after a :meth:`refund` are the same restart, counted once in :attr:`total`."""
        self._times.append(time.monotonic())
        if not self._refunded:
            self.total += 1
        self._refunded = False

    def refund(self) -> None:
        """Give back the budget of the restart just counted: the store refused it (:attr:`total` keeps it)."""
        if self._times:
            self._times.pop()
            self._refunded = True

    def backoff(self) -> float:
        """The wait before the next restart: doubles with the restarts in the window."""
        return min(RESTART_BACKOFF_BASE * 2 ** self.recent(), RESTART_BACKOFF_CAP)

    @staticmethod
    def unavailable_backoff(refused: int) -> float:
        """The wait before try ``refused + 1`` at a store that could not be reached."""
        return min(RESTART_BACKOFF_BASE * 2 ** max(0, refused - 1), UNAVAILABLE_BACKOFF_CAP)


class _CloseRequest(NamedTuple):
    timeout: float
    report: "Future[ShutdownReport]"


class _SwitchRequest(NamedTuple):
    timeout: float  # the old child's close ladder, per stage
    report: "Future[ShutdownReport]"  # how the old child ended, once the new one is built


_Request = _CloseRequest | _SwitchRequest


class Supervisor:
    """Runs one poller child at a time for a buffer (from :meth:`start` on), restarting it within ``budget``.

    ``new_process()`` makes the next (unstarted) child; ``drained(process, final)`` says, after its exit,
    whether everything it sent was applied (``final``: the buffer's last child, not one a switch replaces);
    ``switched()`` is told once a switch closed the old child and built the new one, before it starts;
    ``give_up(error)`` once the budget is used up.
    """

    def __init__(self, name: str, new_process: Callable[[], PollerProcess], *, start_timeout: float,
                 budget: RestartBudget, drained: Callable[[PollerProcess, bool], Callable[[float], bool]],
                 give_up: Callable[[PollerCrashed], None], switched: Callable[[], None]) -> None:
        self.name = name
        self._new_process = new_process
        self._start_timeout = start_timeout
        self._budget = budget
        self._drained = drained
        self._give_up = give_up
        self._switched = switched
        #: The child now (read by stats() from any thread; written by the supervisor only).
        self.process: PollerProcess | None = None
        self.start_retries = 0  # restarts refused by an unreachable store; neither they nor switches use the budget
        self.switches = 0
        self._given_up: PollerCrashed | None = None  # a switch asked for later gets it
        #: Done once the first child said READY (or failed to: PollerStartupError).
        self.started: Future[None] = Future()
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._wake = WakePipe()
        # Under the lock: the running child the thread only watches (else None), and whether a closer took it.
        self._state = threading.Lock()
        self._watched: PollerProcess | None = None
        self._handed_over = False
        self._thread = threading.Thread(target=self._run, name="replay-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def switch(self, timeout: float) -> Future[ShutdownReport]:
        """Replace the running child by a new one from ``new_process()``: a deliberate restart, no crash. The
        future: the old child's close report once the new one is built and ``switched()`` was told;
        :class:`BufferClosed` when a close came first, or the :class:`PollerCrashed` given up with."""
        request = _SwitchRequest(timeout, Future())
        self._requests.put(request)
        self._wake.poke()
        return request.report

    def close(self, timeout: float) -> ShutdownReport:
        """Close the child with the ladder's ``timeout``; how it ended, within :func:`close_bound` (or
        ``concurrent.futures.TimeoutError``: a bug)."""
        request = _CloseRequest(timeout, Future())
        if threading.current_thread() is self._thread:
            # A finalizer run by a garbage collection in this very thread cannot wait for it: served here.
            self._requests.put(request)
            self._wake.poke()
            return self._close(self.process, timeout)
        deadline = time.monotonic() + close_bound(timeout)
        with self._state:
            process = self._watched
            if process is not None:
                self._handed_over = True
        if process is not None:
            request.report.set_result(self._close(process, timeout))
        else:
            self._requests.put(request)
        # After the ladder, not before (woken, the thread took the GIL at every system call up to STOP).
        self._wake.poke()
        # The thread ends right after it answers: joining it wakes the caller once, not twice.
        self._thread.join(close_bound(timeout))
        answer = request.report.result(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            self._wake.close()
        return answer

    def _run(self) -> None:
        request: _Request | None = None
        try:
            request = self._own()
        except BaseException as exc:  # a bug here must not leave a close() waiting for ever
            logger.exception("the supervisor of poller %s failed", self.name)
            if not self.started.done():
                self.started.set_exception(exc)
        if self._handed_over:
            self._answer_pending(None)  # the closing thread runs the ladder
            return
        while not isinstance(request, _CloseRequest):  # given up (or never started): only a close is served
            if isinstance(request, _SwitchRequest):
                self._refuse(request)
            request = self._requests.get()
        report = self._close(self.process, request.timeout)  # the ladder runs once; later calls get its report
        if not request.report.done():
            request.report.set_result(report)
        self._answer_pending(report)  # later requests (there should be none) get the same answer

    def _answer_pending(self, report: ShutdownReport | None) -> None:
        """Answer the requests still queued once the child is closed: a close with its report, a switch refused."""
        while True:
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                return
            if isinstance(request, _SwitchRequest):
                self._refuse(request)
            elif not request.report.done():
                request.report.set_result(report if report is not None else self._close(self.process, request.timeout))

    def _refuse(self, request: _SwitchRequest) -> None:
        if not request.report.done():
            request.report.set_exception(self._given_up if self._given_up is not None
                                         else BufferClosed("the replay buffer is closed"))

    def _own(self) -> _Request | None:
        """Start, watch, restart and switch the child until a close comes; return its request (None: the start
        failed, the budget is used up, or a closing thread took the child over)."""
        process = self.process = self._new_process()
        try:
            process.start(self._start_timeout, abort_fd=self._wake.read_fd)
        except PollerStartupError as exc:
            self.started.set_exception(exc)
            return None
        self.started.set_result(None)
        while True:
            outcome: PollerProcess | _Request | None = self._watch(process)
            if self._handed_over:
                return None
            if outcome is None:  # the child exited by itself
                exitcode = process.join(5.0)
                cause = process.fatal_error()
                process.close(0)  # reap; the stage is "already-exited"
                logger.warning("poller %s (pid %s) exited with code %s%s", self.name, process.pid, exitcode,
                               f": {cause.exc_type}: {cause.message}" if cause else "")
                outcome = self._restart(exitcode, cause)
            while isinstance(outcome, _SwitchRequest):  # also one that came during a restart's backoff
                outcome = self._switch(outcome)
            if not isinstance(outcome, PollerProcess):
                return outcome
            process = outcome

    def _switch(self, request: _SwitchRequest) -> PollerProcess | _Request | None:
        """Close the child, build and start a new one (no restart budget used); or the request that came first."""
        report = self._close(self.process, request.timeout, final=False)
        self.switches += 1
        # Built (its epoch expected) before switched() is told: the old child's late messages are dropped.
        process = self.process = self._new_process()
        self._switched()
        request.report.set_result(report)
        logger.info("poller %s switched to its new source (the old child ended %s)", self.name, report.stage)
        # The switch's own poke, left unread, would cut the new child's start short.
        self._wake.drain()
        if not self._requests.empty():
            return self._requests.get()
        return self._restart(None, None, switched=process)

    def _restart(self, exitcode: int | None, cause: Exception | None,
                 switched: PollerProcess | None = None) -> PollerProcess | _Request | None:
        """A started new child, the request that came first, or None once given up. ``switched``: the new
        child of a switch, started at once without using the budget."""
        budget = self._budget
        free = switched is not None
        process = switched
        refused = 0  # start-ups in a row refused because the store could not be reached
        while free or refused or budget.recent() < budget.max_restarts:
            if process is None:
                request = self._wait(None, budget.unavailable_backoff(refused) if refused else budget.backoff())
                if request is not None:
                    return request
                process = self.process = self._new_process()
                if not free:
                    budget.use()  # before it starts: its data may arrive before start() returns
            try:
                process.start(self._start_timeout, abort_fd=self._wake.read_fd)
            except PollerStartupError as exc:
                process = None
                if not self._requests.empty():
                    return self._requests.get()
                if exc.unavailable:  # retried without using the budget
                    if not free:
                        budget.refund()
                    refused += 1
                    self.start_retries += 1
                    logger.log(logging.WARNING if refused == 1 else logging.DEBUG,
                               "poller %s cannot start, its store is unavailable (try %d, next in %.3gs; "
                               "this uses no restart): %s", self.name, refused, budget.unavailable_backoff(refused),
                               exc)
                    continue
                refused = 0
                if free:  # the new source fails to start: from here it is restarted as a crash is
                    free = False
                    logger.warning("poller %s failed to start on its new source: %s", self.name, exc)
                else:
                    logger.warning("restart %d/%d of poller %s failed: %s", budget.recent(), budget.max_restarts,
                                   self.name, exc)
                cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
                continue
            if free:
                logger.debug("poller %s started on its new source, pid %s", self.name, process.pid)
            else:
                logger.warning("poller %s restarted (%d/%d in %gs), pid %s", self.name, budget.recent(),
                               budget.max_restarts, budget.window, process.pid)
            return process
        error = PollerCrashed(f"poller {self.name} died (exit code {exitcode}) and "
                              f"max_restarts={budget.max_restarts} restarts within {budget.window:g}s were used")
        error.__cause__ = cause
        logger.error("%s", error)
        self._given_up = error
        self._give_up(error)
        return None

    def _watch(self, process: PollerProcess) -> _Request | None:
        """Until the running ``process`` exits or a closing thread takes it over (None), or a request comes."""
        with self._state:
            self._watched = process
        try:
            request = self._wait(process.sentinel, None)
        finally:
            with self._state:
                self._watched = None
                handed_over = self._handed_over
        # Taken over (also just as it exited): the closing thread alone touches it from now on.
        if handed_over:
            if request is not None:
                self._requests.put(request)  # answered once the closing thread is done (_answer_pending)
            return None
        return request

    def _wait(self, sentinel: int | None, timeout: float | None) -> _Request | None:
        """Until ``sentinel`` is readable or ``timeout`` passes (None); a request ends it early."""
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

    def _close(self, process: PollerProcess | None, timeout: float, final: bool = True) -> ShutdownReport:
        if process is None:
            return ShutdownReport("no-poller", 0.0, None, False)
        return process.close(timeout, wait_drained=self._drained(process, final))
