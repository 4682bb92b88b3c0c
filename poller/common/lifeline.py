"""The private pipe between a trainer and the poller process it spawned.

The ZeroMQ stream carries data; this pipe the lifecycle: the child sees EOF the moment the parent
dies (even by SIGKILL), and the parent reads the child's start-up or fatal traceback whether or not
the stream is connected. Records are JSON ``{"kind": <record name>, <fields>}`` checked field by
field, after a 4-byte big-endian length; never pickle, but for the child's configuration (:mod:`buffer.process`).
"""

from __future__ import annotations

import json
import os
import select
import struct
import traceback
from typing import Any, NamedTuple, Union

# The parent's sys.path, through the environment so that `ps` shows a short command (poller.child).
PATH_VARIABLE = "REPLAY_POLLER_SYS_PATH"
# The directory an orphaned poller's watchdog removes (the watchdog is forked before the config is read).
CLEANUP_VARIABLE = "REPLAY_POLLER_ORPHAN_CLEANUP"

__all__ = ["Channel", "Started", "StartFailed", "Fatal", "StopRequest", "LifelineMessage", "send", "recv",
           "failure"]

_MAX_BYTES = 1024 * 1024
_HEADER = struct.Struct("!i")


class Started(NamedTuple):
    """The child built its source and connected: its stream epoch and pid."""

    epoch: int
    pid: int


class StartFailed(NamedTuple):
    """The child could not start; ``unavailable``: the store could not be reached (worth retrying)."""

    type: str
    message: str
    traceback: str
    unavailable: bool = False


class Fatal(NamedTuple):
    """The child is ending on an error (its source failed for good, or a bug): what it was."""

    type: str
    message: str
    traceback: str


class StopRequest(NamedTuple):
    """The parent asks the child to stop (the close ladder's first rung)."""


LifelineMessage = Union[Started, StartFailed, Fatal, StopRequest]
_KINDS: dict[str, Any] = {record.__name__: record for record in (Started, StartFailed, Fatal, StopRequest)}
_TYPES = {"epoch": int, "pid": int, "type": str, "message": str, "traceback": str, "unavailable": bool}


class Channel:
    """One end of the lifeline over a connected stream socket's fd (not multiprocessing's: ~10 ms to import)."""

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


def send(conn: Channel, message: LifelineMessage) -> bool:
    """Send one message; False if the other end is gone."""
    try:
        conn.send_bytes(json.dumps({"kind": type(message).__name__, **message._asdict()}).encode())
        return True
    except (OSError, ValueError):
        return False


def recv(conn: Channel) -> LifelineMessage:
    """Receive one message.

    Raises:
        EOFError: the other end closed (or died).
        ValueError: the bytes are not a lifeline message (unknown kind, a field missing or of the wrong type).
    """
    try:
        data = conn.recv_bytes(_MAX_BYTES)
    except OSError as exc:
        raise EOFError(str(exc)) from exc
    fields = json.loads(data)
    record = _KINDS.get(fields.pop("kind", None)) if isinstance(fields, dict) else None
    if record is None:
        raise ValueError("not a lifeline message of a known kind")
    values = {name: fields.get(name, record._field_defaults.get(name)) for name in record._fields}
    for name, value in values.items():
        # JSON's true is a Python bool, which is also an int: only a bool field takes one.
        if not isinstance(value, _TYPES[name]) or isinstance(value, bool) != (_TYPES[name] is bool):
            raise ValueError(f"lifeline {record.__name__} without a valid {name!r}")
    return record(**values)


def failure(exc: BaseException, record: type[Fatal] | type[StartFailed] = Fatal, **extra: Any) -> Any:
    """A :class:`Fatal` (or :class:`StartFailed`) carrying ``exc``'s type, message and traceback."""
    return record(type(exc).__name__, str(exc),
                  "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), **extra)
