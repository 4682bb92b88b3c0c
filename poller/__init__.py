"""The far side of the wire: a poller process that lists a key-value store
and streams what changed to a :class:`buffer.ReplayBuffer` over ZeroMQ.

Public surface: :class:`PollerProcess` (start, READY handshake, close
ladder), the :class:`Source` protocol with :func:`load_source`, and the
errors. ``python -m poller`` runs a standalone poller or the demo.

This package never imports :mod:`buffer`.
"""

from __future__ import annotations

import logging

from ._version import __version__ as __version__  # one source: poller/_version.py
from .errors import PollerCrashed, PollerError, PollerStartupError, ProtocolError
from .process import PollerProcess
from .sources import Source, load_source

__all__ = [
    "PollerProcess",
    "Source",
    "load_source",
    "PollerError",
    "PollerStartupError",
    "PollerCrashed",
    "ProtocolError",
]

# A library never configures handlers; this only silences "no handler" noise.
logging.getLogger(__name__).addHandler(logging.NullHandler())
