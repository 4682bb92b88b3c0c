"""Start a poller as a fresh interpreter, without ``multiprocessing``.

``multiprocessing``'s ``spawn`` is safe in a trainer that already holds
threads or CUDA, but its child re-imports ``multiprocessing``, unpickles the
parent's preparation data and re-runs the parent's ``__main__`` module (a
trainer script importing torch costs seconds there). The ``exec`` start
method keeps what makes spawn safe — a new interpreter, nothing inherited but
what is passed — and skips the rest::

    parent                                   child: python -m poller.child FD NAME
                                              forks its watchdog first
    Channel.pair() ── child end (pass_fds) ─▶ sys.path = the parent's (from the environment)
    os.pipe() ─────── write end (pass_fds) ─▶ held open until the process ends
    send pickled WorkerConfig ──lifeline───▶ poller.child.main(): run_embedded()

Pickle crosses only this private pipe, from the parent to its own child
(as with spawn); the ZeroMQ stream never carries it.

:class:`ExecProcess` is the child's handle for :class:`~buffer.process.PollerProcess`
(start, signal, join, reap). Its sentinel is the read end of a pipe whose
only write end the child holds: it becomes readable the moment the child's
fds are released at exit. Where Linux offers a pidfd (5.3+), ``join`` waits on
that instead: it becomes readable the moment the child can be reaped, a
little later than the pipe (see :meth:`ExecProcess.join`).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
from typing import Any, Iterable

from poller.wire.lifeline import CLEANUP_VARIABLE, PATH_VARIABLE, Channel

__all__ = ["ExecProcess", "wait"]


def wait(objects: Iterable[Any], timeout: float | None = None) -> list[Any]:
    """The objects (fds or objects with ``fileno()``) readable within ``timeout``.

    Like ``multiprocessing.connection.wait``, without importing it. EOF and
    errors count as readable.
    """
    objects = list(objects)
    fds = {(o if isinstance(o, int) else o.fileno()): o for o in objects}
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = -1 if timeout is None else max(0, int(timeout * 1000 + 0.999))
    return [fds[fd] for fd, _ in poller.poll(ms)]


class ExecProcess:
    """A poller child running ``poller.child`` in a fresh interpreter."""

    def __init__(self, config: Any, name: str) -> None:
        self.name = name
        self._config = config
        self._popen: Any = None
        self._sentinel: int | None = None
        self._pidfd: int | None = None
        self._closed = False

    def start_with(self, child_end: Channel, parent_end: Channel) -> None:
        """Launch the child on ``child_end`` and send it its configuration.

        Raises:
            pickle.PicklingError, TypeError, AttributeError: the configuration
                (a callable source) cannot be pickled; nothing was started.
        """
        import subprocess  # parent only: the child imports this module too

        try:
            payload = pickle.dumps(self._config, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            # The same type, saying what could not be pickled: Python 3.13's own message no longer does.
            raise type(exc)(f"the poller's configuration cannot be pickled for its process (a callable "
                            f"source must be importable by name, or be given as a spec string): {exc}") from exc

        sentinel_r, sentinel_w = os.pipe()
        # -P (3.11+): no current directory in front of the parent's path.
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        argv = [sys.executable, *safe_path, "-m", "poller.child", str(child_end.fileno()), self.name]
        path = os.pathsep.join(sys.path)
        env = dict(os.environ, PYTHONPATH=path, **{PATH_VARIABLE: path})
        if "PYTHONPATH" in os.environ:
            env[PATH_VARIABLE + "_PYTHONPATH"] = os.environ["PYTHONPATH"]  # restored in the child
        env.pop(CLEANUP_VARIABLE, None)
        cleanup = getattr(self._config, "orphan_cleanup", None)
        if cleanup:
            env[CLEANUP_VARIABLE] = cleanup  # for the watchdog, forked before the configuration is read
        try:
            self._popen = subprocess.Popen(argv, pass_fds=(child_end.fileno(), sentinel_w),
                                           stdin=subprocess.DEVNULL, close_fds=True, env=env)
        except BaseException:
            os.close(sentinel_r)
            raise
        finally:
            os.close(sentinel_w)
        self._sentinel = sentinel_r
        self._pidfd = _open_pidfd(self._popen.pid)
        try:
            parent_end.send_bytes(payload)
        except OSError:
            pass  # the child died at once; the start-up wait reports it

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def sentinel(self) -> int:
        if self._closed or self._sentinel is None:
            raise RuntimeError(f"poller child {self.name}: no sentinel (not started, or closed)")
        return self._sentinel

    @property
    def exitcode(self) -> int | None:
        if self._popen is None:
            return None
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` for the child to end, and reap it."""
        if self._popen is None or self._popen.returncode is not None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        # The pidfd is readable once the child is a zombie, so the reap below
        # finds it at its first try. The pipe closes earlier, while the child
        # is still exiting, and Popen.wait(timeout) then polls with sleeps of
        # 0.5, 1, 2 ms...: that was 2.7 ms of an idle close() of 7.7 ms
        # (medians of 21, /tmp probe of bench "close").
        if timeout is not None and not wait([self._exit_fd()], timeout):
            return
        # Without a pidfd, the sentinel closes as the child's fds are released;
        # reaping it takes a moment longer. Still bounded: a child that closed
        # its end of the sentinel itself has not exited at all.
        import subprocess  # parent only, as in start()

        try:
            self._popen.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass

    def _exit_fd(self) -> int:
        """The pidfd where there is one, else the sentinel."""
        if self._pidfd is not None and not self._closed:
            return self._pidfd
        return self.sentinel

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self._popen is not None and self._popen.poll() is None:
            try:
                os.kill(self._popen.pid, signum)
            except ProcessLookupError:
                pass  # it just ended

    def close(self) -> None:
        """Release the sentinel once the child has exited (idempotent).

        Raises:
            RuntimeError: the child still runs (the caller must have reaped it first).
        """
        if self._popen is not None and self._popen.poll() is None:
            raise RuntimeError(f"poller child {self.name} still runs: it cannot be closed")
        if not self._closed:
            for fd in (self._sentinel, self._pidfd):
                if fd is not None:
                    os.close(fd)
        self._closed = True


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of our own unreaped child ``pid`` (it cannot be recycled yet); None where Linux has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux, a kernel before 5.3, or a sandbox refusing it
        return None
