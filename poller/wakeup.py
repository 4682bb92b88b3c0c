"""A self-pipe that wakes a ``zmq.Poller`` or ``multiprocessing.connection.wait``.

Other threads (and signal handlers, through ``signal.set_wakeup_fd``) write a
byte; the thread that waits watches ``read_fd`` beside its sockets.
"""

from __future__ import annotations

import os

__all__ = ["WakePipe"]


class WakePipe:
    """A non-blocking pipe: ``poke()`` from anywhere, ``drain()`` where it is watched."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self._closed = False

    def poke(self) -> None:
        try:
            os.write(self.write_fd, b"\0")
        except OSError:
            pass  # full (already awake) or closed (shutting down)

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        """Idempotent."""
        if self._closed:
            return
        self._closed = True
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
