"""The far side of the wire: a poller process that lists a key-value store
and streams what changed to a :class:`buffer.ReplayBuffer` over ZeroMQ.

Public surface: :class:`PollerProcess` (start, READY handshake, close
ladder), the :class:`Source` protocol with :func:`load_source` and
:class:`SourceStall`, the stream's :class:`Limits`, :class:`CurveServer`,
and the errors with :class:`RemoteTraceback` (the cause a crashed poller
hands over). ``python -m poller`` runs a standalone poller or the demo.

This package never imports :mod:`buffer`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__  # one source: poller/_version.py
from .errors import PollerCrashed, PollerError, PollerStartupError, ProtocolError, RemoteTraceback
from .process import PollerProcess
from .protocol import Limits
from .sources import Source, SourceStall, load_source

if TYPE_CHECKING:
    from .curve import CurveServer

__all__ = [
    "PollerProcess",
    "Source",
    "SourceStall",
    "load_source",
    "Limits",
    "CurveServer",
    "PollerError",
    "PollerStartupError",
    "PollerCrashed",
    "ProtocolError",
    "RemoteTraceback",
]


def __getattr__(name: str) -> Any:
    # poller.curve pulls in zmq.auth and asyncio (~35 ms): only on first use,
    # never in a poller process that does not use CURVE.
    if name == "CurveServer":
        from .curve import CurveServer

        return CurveServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# A library never configures handlers; this only silences "no handler" noise.
logging.getLogger(__name__).addHandler(logging.NullHandler())
