"""The private pipe between a trainer and the poller process it spawned.

The ZeroMQ stream carries data; this pipe carries the lifecycle, because it
has two properties a socket lacks: the child sees EOF the moment the parent
dies (even by SIGKILL), and the parent can read the child's start-up or fatal
traceback without depending on the stream being connected.

Messages are small JSON objects (never pickle): ``{"kind": ..., ...}``.
Child to parent: ``ready``, ``startup_error``, ``fatal``. Parent to child:
``stop``.
"""

from __future__ import annotations

import json
import traceback
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["send", "recv", "exception_fields"]

_MAX_BYTES = 1024 * 1024


def send(conn: Connection, kind: str, **fields: Any) -> bool:
    """Send one message; False if the other end is gone."""
    try:
        conn.send_bytes(json.dumps({"kind": kind, **fields}).encode())
        return True
    except (OSError, ValueError):
        return False


def recv(conn: Connection) -> dict[str, Any]:
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
