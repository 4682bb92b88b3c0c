"""The trainer side: an in-process replay buffer fed by an isolated poller.

Public surface: :class:`ReplayBuffer`, :class:`BatchMeta`,
:class:`ShutdownReport`, and the errors a trainer catches:
:class:`BufferClosed` (you closed it), :class:`PollerCrashed` (the poller
died for good), :class:`PollerStartupError` (it never started),
:class:`InsecureBindError` (a network bind without authentication) and
:class:`EndpointInUseError` (an ``ipc://`` path another live socket holds).
"""

from __future__ import annotations

import logging

from poller._version import __version__ as __version__  # the same release as poller
from poller.errors import PollerCrashed, PollerStartupError
from poller.process import ShutdownReport

from .access import EndpointInUseError, InsecureBindError
from .errors import BufferClosed
from .replay import ReplayBuffer
from .steps import BatchMeta

__all__ = [
    "ReplayBuffer",
    "BatchMeta",
    "ShutdownReport",
    "BufferClosed",
    "InsecureBindError",
    "EndpointInUseError",
    "PollerCrashed",
    "PollerStartupError",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
