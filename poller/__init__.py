"""The poller process: it lists a key-value store and streams what changed to a
:class:`buffer.ReplayBuffer` over ZeroMQ (``python -m poller`` runs one standalone).

Everything here runs in the poller process; :mod:`poller.wire`, :mod:`poller.common` and the store clients of
:mod:`poller.sources` run in a trainer too.
:class:`PollerProcess` (the trainer's launcher, :mod:`buffer.process`) is resolved on first use.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from poller._version import __version__ as __version__
from poller.wire.errors import PollerCrashed, PollerError, PollerStartupError, ProtocolError, RemoteTraceback

if TYPE_CHECKING:
    from poller.sources.contract import Source, SourceStall, load_source
    from poller.wire.curve import CurveServer
    from poller.wire.protocol import Limits

__all__ = ["PollerProcess", "Source", "SourceStall", "load_source", "Limits", "CurveServer", "PollerError",
           "PollerStartupError", "PollerCrashed", "ProtocolError", "RemoteTraceback"]

# Imported on first use: poller.child imports this before its fork; poller.wire.curve imports asyncio.
_CONTRACT = "poller.sources.contract"
_LAZY = {"PollerProcess": "buffer.process", "Source": _CONTRACT, "SourceStall": _CONTRACT, "load_source": _CONTRACT,
         "Limits": "poller.wire.protocol", "CurveServer": "poller.wire.curve"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

# A library never configures handlers; this only silences "no handler" noise.
logging.getLogger(__name__).addHandler(logging.NullHandler())
