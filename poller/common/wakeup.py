"""A self-pipe that other threads and signal handlers (``signal.set_wakeup_fd``) write to, to wake
a thread that watches ``read_fd`` beside its sockets (``zmq.Poller``, ``select``); used on both sides.
"""

from __future__ import annotations

import os
import threading

__all__ = ["WakePipe"]


class WakePipe:
    """A non-blocking pipe: ``poke()`` from anywhere, ``drain()`` where it is watched."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self._closed = False
        # poke() and close() never overlap: a poke after close would write to whatever file reused the number.
        self._lock = threading.Lock()

    def poke(self) -> None:
        """Wake the watcher; a no-op once closed (another thread may poke after the owner closed it)."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self.write_fd, b"\0")
            except OSError:
                pass  # full: already awake

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        """Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self.read_fd, self.write_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass
