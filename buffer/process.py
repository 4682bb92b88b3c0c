"""``PollerProcess``: start a poller process, wait for READY, stop it for sure.

The child is a fresh interpreter, started without ``multiprocessing``::

    parent                                   child: python -m poller.child FD NAME
                                              forks its watchdog first
    Channel.pair() ── child end (pass_fds) ─▶ sys.path = the parent's (from the environment)
    os.pipe() ─────── write end (pass_fds) ─▶ held open until the process ends
    send pickled WorkerConfig ──lifeline───▶ poller.child.main(): run_embedded()

Start-up is a handshake with a deadline over that private pipe (the *lifeline*), the only place pickle
crosses, to our own child. Closing is one ladder with named stages, each wait bounded (a child that had
already died: ``"already-exited"``)::

    STOP ──wait──▶ "graceful"
      └─▶ terminate() ──wait──▶ "terminated"
            └─▶ kill() ──reap──▶ "killed"
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, Literal, NamedTuple, Optional

from poller.common import lifeline
from poller.common.checks import check_seconds, check_worker_config
from poller.common.config import WorkerConfig
from poller.common.lifeline import CLEANUP_VARIABLE, PATH_VARIABLE, Channel
from poller.sources.contract import SourceSpec, describe_spec
from poller.wire.errors import PollerError, PollerStartupError, RemoteTraceback

__all__ = ["PollerProcess", "ShutdownReport", "Stage", "wait"]

logger = logging.getLogger(__name__)

# "closing": returned only to a close() re-entered by a signal handler in the closing thread.
Stage = Literal["graceful", "terminated", "killed", "already-exited", "no-poller", "closing"]


class ShutdownReport(NamedTuple):
    """How a close ended.

    Attributes:
        stage: the last stage of the ladder that was needed.
        seconds: wall time the close took.
        exitcode: the poller's exit code (negative: killed by that signal; ``None``: no poller).
        drained: everything the poller sent before BYE was applied.
    """

    stage: Stage
    seconds: float
    exitcode: Optional[int]
    drained: bool


# After SIGKILL only an unkillable (D-state) process takes longer than this to be reaped.
_KILL_REAP_TIMEOUT = 5.0


def wait(objects: Iterable[Any], timeout: float | None = None) -> list[Any]:
    """The objects (fds or objects with ``fileno()``) readable, EOF or failed within ``timeout``
    (``multiprocessing.connection.wait``, without importing it)."""
    fds = {(o if isinstance(o, int) else o.fileno()): o for o in objects}
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = -1 if timeout is None else max(0, int(timeout * 1000 + 0.999))
    return [fds[fd] for fd, _ in poller.poll(ms)]


class PollerProcess:
    """Handle on one poller process. Start it once, close it once (or more).

    The child is a fresh interpreter running only the poller: safe in processes holding threads or CUDA,
    and unlike ``multiprocessing``'s ``spawn`` it does not re-run the trainer's ``__main__``.

    Args:
        source: ``"package.module:attr"`` or a picklable callable (see :func:`poller.load_source`),
            resolved in the child.
        endpoint: the buffer's ZeroMQ endpoint the child connects to.
        source_kwargs: keyword arguments for the source factory.
        name: the stream's identity; a restarted poller with the same name continues the same stream
            (the buffer computes what vanished).
        poll_interval: seconds between ``kv_list()`` calls, start to start.
        **options: further :class:`~poller.worker.WorkerConfig` fields.
    """

    def __init__(self, source: SourceSpec, *, endpoint: str, source_kwargs: dict[str, Any] | None = None,
                 name: str | None = None, poll_interval: float = 1.0, **options: Any) -> None:
        self.name = name or f"poller-{os.getpid()}-{id(self):x}"
        self.config = WorkerConfig(source=source, endpoint=endpoint, name=self.name,
                                   source_kwargs=dict(source_kwargs or {}), poll_interval=poll_interval,
                                   **options)
        check_worker_config(self.config)
        self._popen: subprocess.Popen[bytes] | None = None
        # The read end of a pipe whose only write end the child holds: readable as the child's fds are
        # released at exit. A pidfd (Linux 5.3+) is readable once the child can be reaped, a little later.
        self._sentinel: int | None = None
        self._pidfd: int | None = None
        self._fds_closed = False
        self._conn: lifeline.Channel | None = None
        self._lock = threading.Lock()
        self._report: ShutdownReport | None = None
        self._close_requested = False
        self._fatal: RemoteTraceback | None = None
        self.epoch: int | None = None

    def __repr__(self) -> str:
        state = "closed" if self._report else ("running" if self.is_alive() else "not running")
        return f"<PollerProcess {self.name} pid={self.pid} {state} source={describe_spec(self.config.source)}>"

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the process ends."""
        if self._conn is None:
            raise PollerError("the poller has not been started")
        if self._fds_closed or self._sentinel is None:
            raise RuntimeError(f"poller child {self.name}: no sentinel (not started, or closed)")
        return self._sentinel

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll() if self._popen is not None else None

    def is_alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def join(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` for the process to end; return its exit code."""
        if self._report is None:
            self._reap(timeout)
        return self.exitcode

    def start(self, timeout: float = 30.0, *, abort_fd: int | None = None) -> None:
        """Spawn the child and wait until it says READY; ``abort_fd`` readable (a close request) gives up at once.

        Raises:
            PollerStartupError: the child failed (its traceback is the ``__cause__``), died, or gave no
                READY within ``timeout``; it is gone. ``unavailable``: the source could not reach its store
                (``ConnectionError``, ``TimeoutError``) or gave no READY in time, so a later try may work.
            ValueError: ``timeout`` is not a finite number of seconds > 0.
        """
        timeout = check_seconds("timeout", timeout)
        if self._conn is not None:
            raise PollerError("a PollerProcess can be started only once")
        self._conn, child_conn = lifeline.Channel.pair()
        try:
            try:
                self._spawn(child_conn)
            finally:
                child_conn.close()  # the parent must not hold the child's end, or it would never see EOF
            self._await_ready(timeout, abort_fd)
        except BaseException:
            self._discard()
            raise
        logger.debug("poller %s started: pid %s, epoch %s", self.name, self.pid, self.epoch)

    def _spawn(self, child_end: Channel) -> None:
        """Launch ``python -m poller.child`` on ``child_end`` and send it its configuration; one that cannot be
        pickled (a callable source) raises ``PicklingError``/``TypeError``/``AttributeError`` before any start."""
        assert self._conn is not None
        try:
            payload = pickle.dumps(self.config, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            # The same type, saying what could not be pickled: Python 3.13's own message no longer does.
            raise type(exc)(f"the poller's configuration cannot be pickled for its process (a callable "
                            f"source must be importable by name, or be given as a spec string): {exc}") from exc
        sentinel_r, sentinel_w = os.pipe()
        # -P (3.11+): no current directory in front of the parent's path.
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        argv = [sys.executable, *safe_path, "-m", "poller.child", str(child_end.fileno()), f"poller:{self.name}"]
        path = os.pathsep.join(sys.path)
        env = dict(os.environ, PYTHONPATH=path, **{PATH_VARIABLE: path})
        if "PYTHONPATH" in os.environ:
            env[PATH_VARIABLE + "_PYTHONPATH"] = os.environ["PYTHONPATH"]  # restored in the child
        env.pop(CLEANUP_VARIABLE, None)
        if self.config.orphan_cleanup:
            env[CLEANUP_VARIABLE] = self.config.orphan_cleanup  # for the watchdog, forked before the config is read
        try:
            self._popen = subprocess.Popen(argv, pass_fds=(child_end.fileno(), sentinel_w),
                                           stdin=subprocess.DEVNULL, close_fds=True, env=env)
        except BaseException:
            os.close(sentinel_r)
            raise
        finally:
            os.close(sentinel_w)
        self._sentinel = sentinel_r
        try:  # our own unreaped child: its pid cannot be recycled yet
            self._pidfd = os.pidfd_open(self._popen.pid)
        except (AttributeError, OSError):  # not Linux, a kernel before 5.3, or a sandbox refusing it
            pass
        try:
            self._conn.send_bytes(payload)
        except OSError:
            pass  # the child died at once; the start-up wait reports it

    def _await_ready(self, timeout: float, abort_fd: int | None = None) -> None:
        assert self._conn is not None
        deadline = time.monotonic() + timeout
        spec = describe_spec(self.config.source)
        closed = PollerStartupError(f"poller for {spec} was closed while starting")
        sentinel = self.sentinel  # read once: a concurrent close() may release it
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PollerStartupError(f"poller for {spec} gave no READY within {timeout:g}s", unavailable=True)
            if self._report is not None:
                raise closed
            try:
                ready = wait([self._conn, sentinel, *([] if abort_fd is None else [abort_fd])], remaining)
                readable = self._conn in ready or self._conn.poll(0)
            except (OSError, ValueError):  # closed by a concurrent close()
                raise closed from None
            if abort_fd is not None and abort_fd in ready and not readable:
                raise closed
            if readable:
                try:
                    message = lifeline.recv(self._conn)
                except (EOFError, ValueError):
                    message = None
                match message:
                    case lifeline.Started(epoch=epoch):
                        self.epoch = epoch
                        return
                    case lifeline.StartFailed(type=kind, message=text, traceback=trace, unavailable=unavailable):
                        raise PollerStartupError(f"poller for {spec} failed to start: {kind}: {text}",
                                                 unavailable=unavailable) from RemoteTraceback(kind, text, trace)
                if message is None and (self._close_requested or wait([sentinel], 0)):
                    self._died_starting(spec, closed)
            elif sentinel in ready:
                self._died_starting(spec, closed)

    def _died_starting(self, spec: str, closed: PollerStartupError) -> None:
        # A concurrent close() reaps the child itself: reaped here too, that close() could miss the
        # exit status (its waitpid fails) and escalate against a dead pid.
        if self._close_requested:
            raise closed
        self._reap(1.0)
        raise PollerStartupError(f"poller for {spec} died during start-up (exit code {self.exitcode})")

    def _discard(self) -> None:
        """Undo a failed start: the child and the pipe are gone afterwards."""
        with self._lock:
            if self._report is not None:  # a concurrent close() already did it
                return
            if self._popen is not None:
                if wait([self.sentinel], 0):
                    self._reap(_KILL_REAP_TIMEOUT)
                self._signal(signal.SIGKILL)
                self._reap(_KILL_REAP_TIMEOUT)
            if self._conn is not None:
                self._conn.close()
            exitcode = self.exitcode
            self._report = ShutdownReport("killed" if exitcode == -9 else "already-exited", 0.0, exitcode, False)
            if exitcode is not None:
                self._release()

    def fatal_error(self) -> RemoteTraceback | None:
        """The traceback the child sent before dying of a source failure, if any."""
        conn = self._conn
        try:
            while conn is not None and not conn.closed and conn.poll(0):
                message = lifeline.recv(conn)
                if isinstance(message, lifeline.Fatal):
                    self._fatal = RemoteTraceback(message.type, message.message, message.traceback)
        except (EOFError, ValueError, OSError):
            pass
        return self._fatal

    def close(self, timeout: float = 5.0, *,
              wait_drained: Callable[[float], bool] | None = None) -> ShutdownReport:
        """Stop the child: STOP, then ``terminate()``, then ``kill()``, the first two waiting up to ``timeout``.
        ``wait_drained(seconds)``, asked once the child exited: was everything it sent applied? Idempotent
        and thread-safe: every caller gets the same report. ``ValueError``: ``timeout`` is not seconds >= 0."""
        timeout = check_seconds("timeout", timeout, allow_zero=True)
        self._close_requested = True  # read by a start() still waiting for READY
        with self._lock:
            if self._report is None:
                self._report = self._close_ladder(timeout, wait_drained)
            return self._report

    def _close_ladder(self, timeout: float, wait_drained: Callable[[float], bool] | None) -> ShutdownReport:
        started = time.monotonic()
        if self._popen is None:
            return ShutdownReport("no-poller", 0.0, None, False)
        stage: Stage
        if wait([self.sentinel], 0):
            # Its sentinel closes a moment before the child can be reaped.
            self._reap(_KILL_REAP_TIMEOUT)
        if not self.is_alive():
            stage = "already-exited"
        else:
            stage = "graceful"
            if self._conn is not None:
                lifeline.send(self._conn, lifeline.StopRequest())
            self._reap(timeout)
            if self.exitcode is None:
                logger.warning("poller %s (pid %s) did not stop within %.3gs; terminating", self.name, self.pid,
                               timeout)
                stage = "terminated"
                self._signal(signal.SIGTERM)
                self._reap(timeout)
            if self.exitcode is None:
                logger.warning("poller %s (pid %s) ignored SIGTERM for %.3gs; killing", self.name, self.pid, timeout)
                stage = "killed"
                self._signal(signal.SIGKILL)
                self._reap(_KILL_REAP_TIMEOUT)
        exitcode = self.exitcode
        drained = False
        if wait_drained is not None and stage in ("graceful", "terminated", "already-exited"):
            drained = wait_drained(max(0.05, min(1.0, timeout)))
        self.fatal_error()  # read what the child left in the pipe before closing it
        if self._conn is not None:
            self._conn.close()
        if exitcode is not None:
            self._release()
        else:
            logger.error("poller %s (pid %s) survived SIGKILL for %ss", self.name, self.pid, _KILL_REAP_TIMEOUT)
        report = ShutdownReport(stage, time.monotonic() - started, exitcode, drained)
        logger.debug("poller %s closed: %s", self.name, report)
        return report

    def _reap(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` for the child to end, and reap it."""
        if self._popen is None or self._popen.returncode is not None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        # The pidfd is readable once the child is a zombie, so the reap below finds it at once; after the
        # pipe (earlier), Popen.wait() would poll with growing sleeps.
        exit_fd = self._pidfd if self._pidfd is not None and not self._fds_closed else self.sentinel
        if timeout is not None and not wait([exit_fd], timeout):
            return
        # Bounded: a child that closed its end of the sentinel itself has not exited at all.
        try:
            self._popen.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass

    def _signal(self, signum: int) -> None:
        if self._popen is not None and self._popen.poll() is None:
            try:
                os.kill(self._popen.pid, signum)
            except ProcessLookupError:
                pass  # it just ended

    def _release(self) -> None:
        """Close the sentinel and the pidfd of the reaped child (idempotent)."""
        if not self._fds_closed:
            for fd in (self._sentinel, self._pidfd):
                if fd is not None:
                    os.close(fd)
        self._fds_closed = True

    def __enter__(self) -> "PollerProcess":
        if self._conn is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
