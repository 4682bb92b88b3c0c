"""The poller process: it lists a key-value store and streams what changed
to a :class:`buffer.ReplayBuffer` over ZeroMQ.

Everything here runs in the poller process, except :mod:`poller.wire`, what
both processes share. Public surface: the :class:`Source` protocol with
:func:`load_source` and :class:`SourceStall`, the stream's :class:`Limits`,
:class:`CurveServer`, the errors with :class:`RemoteTraceback` (the cause a
crashed poller hands over), and :class:`PollerProcess` (start, READY
handshake, close ladder), which runs in the trainer and lives in
:mod:`buffer.process`: the name is resolved there on first use, so a poller
process never loads :mod:`buffer`. ``python -m poller`` runs a standalone
poller.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from poller._version import __version__ as __version__  # one source: poller/_version.py
from poller.wire.errors import PollerCrashed, PollerError, PollerStartupError, ProtocolError, RemoteTraceback

if TYPE_CHECKING:
    from poller.wire.curve import CurveServer
    from poller.wire.protocol import Limits
    from poller.wire.sources import Source, SourceStall, load_source

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
# poller.wire.curve pulls in zmq.auth and asyncio (~35 ms): never in a poller that does not use CURVE.
# PollerProcess is the trainer's (buffer.process): kept importable from here for compatibility.
_LAZY = {"PollerProcess": "buffer.process", "Source": "poller.wire.sources", "SourceStall": "poller.wire.sources",
         "load_source": "poller.wire.sources", "Limits": "poller.wire.protocol", "CurveServer": "poller.wire.curve"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

# A library never configures handlers; this only silences "no handler" noise.
logging.getLogger(__name__).addHandler(logging.NullHandler())
