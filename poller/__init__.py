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

import importlib
import logging
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__  # one source: poller/_version.py
from .errors import PollerCrashed, PollerError, PollerStartupError, ProtocolError, RemoteTraceback

if TYPE_CHECKING:
    from .curve import CurveServer
    from .process import PollerProcess
    from .protocol import Limits
    from .sources import Source, SourceStall, load_source

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

# Imported on first use. A poller process starts as `python -m poller.child`, which imports this
# package first, and forks its watchdog before anything heavy is loaded (zmq, msgpack, the
# source): a small process forks fast and leaves the poller few pages to copy on write later.
# poller.curve pulls in zmq.auth and asyncio (~35 ms): never in a poller that does not use CURVE.
_LAZY = {"PollerProcess": ".process", "Source": ".sources", "SourceStall": ".sources", "load_source": ".sources",
         "Limits": ".protocol", "CurveServer": ".curve"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value

# A library never configures handlers; this only silences "no handler" noise.
logging.getLogger(__name__).addHandler(logging.NullHandler())
