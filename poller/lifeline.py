"""The private pipe between a trainer and the poller process it spawned.

The ZeroMQ stream carries data; this pipe carries the lifecycle, because it
has two properties a socket lacks: the child sees EOF the moment the parent
dies (even by SIGKILL), and the parent can read the child's start-up or fatal
traceback without depending on the stream being connected.

Messages are small JSON objects (never pickle): ``{"kind": ..., ...}``.
Child to parent: ``ready``, ``startup_error``, ``fatal``. Parent to child:
``stop``. (The one exception is the start-up configuration a launched child
reads first, see :mod:`poller.launch`: its own parent wrote it.)

Either end is a :class:`Channel` or a ``multiprocessing`` ``Connection``:
both frame a message as a 4-byte big-endian length and the bytes.
"""

from __future__ import annotations

import json
import os
import select
import struct
import traceback
from typing import Any, Protocol

__all__ = ["Channel", "Endpoint", "send", "recv", "exception_fields"]

_MAX_BYTES = 1024 * 1024
_HEADER = struct.Struct("!i")


class Endpoint(Protocol):
    """What this module needs of one end of the pipe."""

    def send_bytes(self, data: bytes) -> None: ...
    def recv_bytes(self, maxlength: int = ...) -> bytes: ...
    def poll(self, timeout: float = ...) -> bool: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...


class Channel:
    """One end of the lifeline over a connected stream socket's fd.

    The framing is ``multiprocessing.connection``'s, without importing
    ``multiprocessing`` into the poller (about 10 ms of start-up).
    """

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def pair(cls) -> tuple["Channel", "Channel"]:
        import socket

        a, b = socket.socketpair()
        return cls(a.detach()), cls(b.detach())

    @property
    def closed(self) -> bool:
        return self._fd is None

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError("the lifeline channel is closed")
        return self._fd

    def send_bytes(self, data: bytes) -> None:
        view = memoryview(_HEADER.pack(len(data)) + data)
        while view:
            view = view[os.write(self.fileno(), view):]

    def recv_bytes(self, maxlength: int = _MAX_BYTES) -> bytes:
        (size,) = _HEADER.unpack(self._read(_HEADER.size))
        if size < 0 or size > maxlength:
            raise OSError(f"bad lifeline message length {size}")
        return self._read(size)

    def _read(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = os.read(self.fileno(), n)
            if not chunk:
                raise EOFError("the lifeline closed")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def poll(self, timeout: float = 0.0) -> bool:
        """True when a message (or EOF) can be read without blocking."""
        return bool(select.select([self.fileno()], [], [], timeout)[0])

    def close(self) -> None:
        """Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def send(conn: Endpoint, kind: str, **fields: Any) -> bool:
    """Send one message; False if the other end is gone."""
    try:
        conn.send_bytes(json.dumps({"kind": kind, **fields}).encode())
        return True
    except (OSError, ValueError):
        return False


def recv(conn: Endpoint) -> dict[str, Any]:
    """Receive one message.

    Raises:
        EOFError: the other end closed (or died).
        ValueError: the bytes are not a lifeline message.
    """
    try:
        data = conn.recv_bytes(_MAX_BYTES)
    except OSError as exc:
        raise EOFError(str(exc)) from exc
    message = json.loads(data)
    if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
        raise ValueError("lifeline message without a kind")
    return message


def exception_fields(exc: BaseException) -> dict[str, str]:
    """The type, message and formatted traceback of ``exc``."""
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }
